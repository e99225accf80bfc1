"""A tensor-parallel + FSDP2 training script as a torch user writes it (torch's names only), run
under ``torchrun``.  Prints one JSON line per rank: losses, a parameter checksum and whose DTensor
ran.  ``tests/test_dropin.py`` runs it with torch's DTensor and under ``-m shardtensor.dropin``."""
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def build() -> nn.Module:
    """The model, its values from a private generator (the same on every rank and on one device)."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: 4 rows per dp rank."""
    data = torch.Generator().manual_seed(10 + step)
    return torch.randn(4 * (world // 2), 8, generator=data), torch.randn(4 * (world // 2), 8, generator=data)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = build()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    dp = mesh.get_local_rank("dp")
    losses = []
    for step in range(3):
        x, y = batch(step, world)
        loss = ((model(x[4 * dp:4 * dp + 4]) - y[4 * dp:4 * dp + 4]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    sd = get_model_state_dict(model)
    whole = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sd.items()}
    print(json.dumps({"rank": rank, "losses": losses, "checksum": sum(float(v.double().sum()) for v in whole.values()),
                      "dtensor": DTensor.__module__, "mesh": type(mesh).__module__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
