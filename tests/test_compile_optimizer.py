"""A compiled optimizer step (``torch.compile(opt.step)``) over DTensor parameters.

Compiling the step is how users take the optimizer's per-op overhead away (it is most of a
small compiled model's step).  The step traces through our foreach dispatch, including a TP
model's list of sharded and plain (unsharded) parameters, which run as plain tensors
(``listops.py``).  Each case: three Adam steps, compiled, over the sharded model and over the
plain model from the same values and gradients; every parameter must agree (1e-6: compiled Adam
differs from eager Adam by ~3e-4 here, for plain tensors as for ours, so the reference is the
plain model's compiled step), and steps 2 and 3 compile nothing new.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from distributed import gloo_available, run_multiprocess

from shardtensor import DTensor, distribute_tensor, init_device_mesh, run_spmd
from shardtensor.comm import current_transport
from shardtensor.compile import methods_traced
from shardtensor.examples.tiny_lm import build_model, tp_plan
from shardtensor.fsdp import fully_shard
from shardtensor.parallel import parallelize_module


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _shard(m: nn.Module, kind: str) -> None:
    world = current_transport().world_size
    mesh = init_device_mesh("cpu", (world,))
    if kind == "2d":  # torch's 2-D recipe: the weights on the 2-D mesh, the norms on dp (two meshes)
        parent = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        for blk in m.blocks:
            parallelize_module(blk, parent["tp"], tp_plan())
            fully_shard(blk, mesh=parent["dp"])
        fully_shard(m, mesh=parent["dp"])
        return
    for blk in m.blocks:
        if kind == "tp":  # the embeddings, norms and head stay plain tensors
            parallelize_module(blk, mesh, tp_plan())
        else:
            fully_shard(blk, mesh=mesh)
    if kind == "fsdp":
        fully_shard(m, mesh=mesh)


def _steps(kind: str, impl: str, backend: str) -> dict:
    models = [build_model(0) for _ in range(2)]
    _shard(models[0], kind)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, **{impl: True}) for m in models]
    steps = [torch.compile(o.step, backend=backend) for o in opts]
    graphs, kinds = [], {type(p) for p in models[0].parameters()}
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        for p, q in zip(models[0].parameters(), models[1].parameters()):  # the same gradients
            q.grad = torch.randn(q.shape, generator=g)
            p.grad = distribute_tensor(q.grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else q.grad.clone()
        for s in steps:
            s()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    with torch.no_grad():
        worst = max(float((_whole(p) - _whole(q)).abs().max())
                    for p, q in zip(models[0].parameters(), models[1].parameters()))
        moved = max(float((_whole(p) - _whole(q)).abs().max())
                    for p, q in zip(models[0].parameters(), build_model(0).parameters()))
    return dict(worst=worst, moved=moved, graphs=graphs, plain=torch.nn.Parameter in kinds)


def _ok(r: dict, kind: str) -> bool:
    return (r["worst"] <= 1e-6 and r["moved"] > 1e-3 and r["graphs"][0] > 0 and r["graphs"][0] == r["graphs"][-1]
            and r["plain"] == (kind == "tp"))


@pytest.mark.skipif(not methods_traced(), reason="placements are graph constants from torch 2.13 on")
@pytest.mark.parametrize("kind,impl,backend", [("tp", "foreach", "inductor"), ("fsdp", "foreach", "inductor"),
                                               ("2d", "foreach", "inductor"), ("tp", "foreach", "aot_eager")])
def test_a_compiled_adam_step_over_dtensor_parameters_matches_eager(kind, impl, backend):
    r = run_spmd(_steps, 1, kind, impl, backend)[0]
    assert _ok(r, kind), r


KINDS = ("tp", "fsdp", "2d")


def _gloo(rank: int, world: int) -> list[dict]:
    out = []
    for kind in KINDS:
        torch._dynamo.reset()
        out.append(_steps(kind, "foreach", "inductor"))
    return out


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
@pytest.mark.skipif(not gloo_available() or not methods_traced(), reason="needs gloo and torch 2.13 or newer")
def test_a_compiled_adam_step_matches_eager_in_gloo_processes():
    for per_rank in run_multiprocess(_gloo, 2, timeout=600):
        for kind, r in zip(KINDS, per_rank):
            assert _ok(r, kind), (kind, r)
