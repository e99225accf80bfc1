"""FSDP2 over a full-DTensor model (torchtitan's ``full_dtensor`` backend), written with torch's
names only, under ``torchrun`` with 4 processes: every parameter is a DTensor on the whole
(dp_shard, tp) mesh, ``fully_shard(..., mesh=whole, dp_mesh_dims=DataParallelMeshDims(shard=
"dp_shard"))``, the batch a DTensor sharded over dp_shard, the loss a DTensor; then the same on a
1-D ("dp_shard",) mesh.  Also ``register_fsdp_forward_method``, ``share_comm_ctx`` and
``register_sharding`` (torch's own docstring example).  Prints one JSON line per rank;
``tests/test_dropin.py`` runs it with torch's DTensor and under ``-m shardtensor.dropin``."""
import json

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (DataParallelMeshDims, FSDPModule, fully_shard, register_fsdp_forward_method,
                                    share_comm_ctx)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import register_sharding

aten = torch.ops.aten


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 12), nn.Linear(12, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(h)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.gain = nn.Parameter(torch.ones(8))  # the root's own

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = b(h)
        return h * self.gain

    def score(self, h: torch.Tensor) -> torch.Tensor:
        """A method other than forward that reads a parameter itself (as a generate does)."""
        return self(h) * self.gain


def build(tp_layout: bool, mesh) -> nn.Module:
    """The model with every parameter a DTensor on ``mesh``: Replicate over dp_shard, and on the
    tp dim (if any) column-wise ``up``, row-wise ``down`` (the bias of ``down`` replicated)."""
    g = torch.Generator().manual_seed(0)
    model = Model()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    rest = [Replicate()] if tp_layout else []
    model.gain = nn.Parameter(distribute_tensor(model.gain.detach(), mesh, [Replicate(), *rest]))
    for block in model.blocks:
        for name, p in list(block.named_parameters()):
            mod, leaf = getattr(block, name.split(".")[0]), name.split(".")[1]
            tp = [Shard(0)] if name.startswith("up") else [Shard(1)] if name == "down.weight" else [Replicate()]
            pl = [Replicate(), *tp] if tp_layout else [Replicate()]
            setattr(mod, leaf, nn.Parameter(distribute_tensor(p.detach(), mesh, pl)))
    return model


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(10 + step))


def train(mesh, tp_layout: bool) -> tuple[list[float], float]:
    model = build(tp_layout, mesh)
    dims = DataParallelMeshDims(shard="dp_shard")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    share_comm_ctx([model, *model.blocks])
    register_fsdp_forward_method(model, "score")
    assert all(isinstance(b, FSDPModule) for b in model.blocks)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rest = [Replicate()] if tp_layout else []
    losses = []
    for step in range(3):
        x = distribute_tensor(batch(step), mesh, [Shard(0), *rest])
        loss = (model.score(x) if step == 2 else model(x)).pow(2).mean()
        loss.backward()
        losses.append(loss.full_tensor().item())
        opt.step()
        opt.zero_grad()
    checksum = sum(float(p.full_tensor().double().sum()) for p in model.parameters())
    return losses, checksum


def custom_softmax(mesh) -> tuple[str, float]:
    @register_sharding(aten._softmax.default)
    def custom_softmax_sharding(x, dim, half_to_float):
        softmax_dim = dim if dim >= 0 else dim + x.ndim
        acceptable = [([Replicate()], [Replicate(), None, None])]
        for d in range(x.ndim):
            if d != softmax_dim:
                acceptable.append(([Shard(d)], [Shard(d), None, None]))
        return acceptable

    x = distribute_tensor(batch(5).reshape(4, 16), mesh, [Shard(1)])
    y = torch.softmax(x, 1)
    return str(list(y.placements)), float((y.full_tensor() * torch.arange(16.0)).sum())


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    whole = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    tp_losses, tp_sum = train(whole, True)
    line = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    dp_losses, dp_sum = train(line, False)
    softmax_pl, softmax_sum = custom_softmax(line)
    print(json.dumps({"rank": rank, "tp_losses": tp_losses, "tp_sum": tp_sum, "dp_losses": dp_losses,
                      "dp_sum": dp_sum, "softmax": softmax_pl, "softmax_sum": softmax_sum,
                      "dtensor": DTensor.__module__, "mesh": type(whole).__module__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
