"""torch.compile on DTensors named the torch way (both import forms), in the simulated world.
``tests/test_dropin.py`` runs it under ``python -m shardtensor.dropin``; prints OK."""
import torch
import torch.distributed.tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def f(x):
    y = x * 2 + 1 if isinstance(x, torch.distributed.tensor.DTensor) else x * 3  # attribute form, traced
    return y.sum(0)


def body():
    mesh = init_device_mesh("cpu", (2,))
    g = torch.compile(f, backend="aot_eager")
    full = torch.arange(12.0).reshape(4, 3)
    for placements in ([Shard(0)], [Shard(1)], [Replicate()], [Shard(0)]):
        out = g(distribute_tensor(full, mesh, placements))
        assert torch.equal(out.full_tensor(), (full * 2 + 1).sum(0)), (placements, out.full_tensor())
    return True


if __name__ == "__main__":
    import shardtensor

    assert torch.distributed.tensor.DTensor is shardtensor.DTensor
    assert shardtensor.run_spmd(body, 2) == [True, True]
    print("OK")
