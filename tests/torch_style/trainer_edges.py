"""What a trainer such as torchtitan touches beyond the public DTensor names, written as torch's
users write it (torch's names only), run under ``torchrun`` with 4 processes: meshes built by
``DeviceMesh._unflatten`` / ``_flatten``, the list form of ``fully_shard``, FSDP2's
``FSDPModule`` methods found through ``torch.distributed._composable.fsdp`` (gradient division
off, the trainer divides by the global token count itself; sum-only reductions; no reshard
after backward while accumulating; ``unshard(async_op=True)``), functional collectives over a
mesh, ``local_map`` with torch's per-output ``out_placements`` and ``parallelize_module``
from ``torch.distributed.tensor.parallel.api``.  Prints one JSON line per rank;
``tests/test_dropin.py`` runs it with torch's DTensor and under ``-m shardtensor.dropin``."""
import json

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed._composable.fsdp import FSDPModule
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.api import parallelize_module


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(h)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.norm, self.out = nn.Linear(8, 16), Block(), nn.LayerNorm(16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.block(self.inp(x))))


def build() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    model = Model()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def tp_sharded(model: nn.Module) -> list[nn.Parameter]:
    """The parameters sharded on both mesh dims (``down.bias`` is replicated over tp)."""
    return [model.block.up.weight, model.block.up.bias, model.block.down.weight]


STEPS, MICRO, ROWS = 3, 2, 3  # rows per dp rank and microbatch


def batch(step: int, micro: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one microbatch: ``ROWS`` rows per dp rank."""
    data = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(ROWS * dp, 8, generator=data), torch.randn(ROWS * dp, 8, generator=data)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (2, 2), ("dp", "tp"), backend_override={"tp": "gloo"})
    loss_mesh = mesh["dp"]._flatten("loss")
    model = build()
    parallelize_module(model.block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model.block, mesh=mesh["dp"])
    fully_shard([model.norm, model.out], mesh=mesh["dp"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["dp"])
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m.set_gradient_divide_factor(1.0)  # the loss is divided by the global row count below
        m.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = mesh.get_local_rank("dp")
    rows = ROWS * mesh["dp"].size() * MICRO
    losses, grad_sq = [], []
    for step in range(STEPS):
        if step == 2:
            model.block.unshard(async_op=True).wait()
        total = torch.zeros(())
        for micro in range(MICRO):
            last = micro == MICRO - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            x, y = batch(step, micro, mesh["dp"].size())
            part = slice(ROWS * dp, ROWS * dp + ROWS)
            loss = ((model(x[part]) - y[part]) ** 2).sum() / rows
            loss.backward()
            total = total + loss.detach()
        losses.append(funcol.all_reduce(total, "sum", group=loss_mesh).item())
        assert funcol.all_reduce(total, "sum", group=(mesh, 0)).item() == losses[-1]
        sq = local_map(lambda g: (g.double() ** 2).sum(), out_placements=((Partial(), Partial()),))
        grad_sq.append(sum(sq(p.grad).full_tensor().item() for p in tp_sharded(model)))
        opt.step()
        opt.zero_grad()
    whole = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
    print(json.dumps({"rank": rank, "losses": losses, "grad_sq": grad_sq, "fsdp_modules": len(fsdp_modules),
                      "checksum": sum(float(v.double().sum()) for v in whole.values()),
                      "dtensor": DTensor.__module__, "mesh": type(mesh).__module__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
