"""Auto-sharding: the chosen plan and every hand plan, applied to a real model, train as one device
does, and the bytes each rank receives per step are the predicted ones."""
from __future__ import annotations

import copy

import pytest
import torch

from shardtensor import run_spmd
from shardtensor.auto import autoshard
from shardtensor.auto.layout import Layout
from shardtensor.comm.issue import recording
from shardtensor.examples import tiny_lm as T
from shardtensor.mesh import init_device_mesh

MESHES = [((4,), ("d0",)), ((2, 2), ("dp", "tp")), ((2, 2), ("a", "b"))]


def _loss(out):
    return out.float().pow(2).mean()


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, T.VOCAB, (T.BATCH, T.SEQ), generator=torch.Generator().manual_seed(step))


def _one_device(model: torch.nn.Module, steps: int) -> list[float]:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    out = []
    for s in range(steps):
        opt.zero_grad()
        loss = _loss(model(_batch(s)))
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _run(plan, layout: Layout, model: torch.nn.Module, steps: int) -> tuple[list[float], int]:
    """Train ``model`` under ``layout`` in a simulated world; rank 0's losses and bytes of step 0."""
    shape, names = layout.mesh_shape, layout.names

    def body() -> tuple[list[float], int]:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        m = layout.apply(copy.deepcopy(model), mesh, plan.blocks)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
        losses, first = [], 0
        for s in range(steps):
            opt.zero_grad()
            with recording() as log:
                loss = _loss(m(_batch(s)))
                loss.backward()
                opt.step()
            if s == 0:
                first = sum(e.bytes_received for e in log.events if e.rank == 0)
            losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
        return losses, first

    n = 1
    for k in shape:
        n *= k
    return run_spmd(body, n)[0]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return T.build_model(0)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m[0])) + "-" + ",".join(m[1]))
def test_plans_train_as_one_device_and_bytes_are_predicted(model, mesh) -> None:
    plan = autoshard(model, mesh, _batch(0), loss_fn=_loss)
    ref = _one_device(model, 2)
    for name, priced in [("autoshard", plan.search.best), *plan.hand]:
        losses, got = _run(plan, priced.layout, model, 2)
        assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6), name
        assert got == round(priced.cost.bytes), (name, priced.layout)
        assert plan.search.best.cost.step_s <= priced.cost.step_s, name
    assert plan.predicted_bytes_per_rank == round(plan.search.best.cost.bytes)
    text = str(plan)
    assert "autoshard" in text and "FSDP" in text and "blocks.*" in text


def test_meta_model_and_tp_styles(model) -> None:
    with torch.device("meta"):
        meta = T.TinyLM()
    plan = autoshard(meta, ((2, 2), ("dp", "tp")), _batch(0), loss_fn=_loss)
    tp = {p.layout.tp: dict(p.layout.tp_plan) for _, p in plan.hand if p.layout.tp is not None}
    assert tp[1] == {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
                     "mlp.up": "colwise", "mlp.down": "rowwise"}
    real = autoshard(model, ((2, 2), ("dp", "tp")), _batch(0), loss_fn=_loss)
    assert real.predicted_bytes_per_rank == plan.predicted_bytes_per_rank
    assert real.layout == plan.layout


def test_memory_budget(model) -> None:
    free = autoshard(model, (4,), _batch(0), loss_fn=_loss)
    least = min(p.cost.memory for _, p in free.hand)
    tight = autoshard(model, (4,), _batch(0), loss_fn=_loss, memory_per_rank=least)
    assert tight.memory_per_rank <= least
    assert tight.predicted_step_s >= free.predicted_step_s
    with pytest.raises(ValueError, match="no plan fits memory_per_rank"):
        autoshard(model, (4,), _batch(0), loss_fn=_loss, memory_per_rank=1000)


def test_bad_arguments(model) -> None:
    with pytest.raises(TypeError, match="mesh must be"):
        autoshard(model, "8x8", _batch(0))
    with pytest.raises(ValueError, match="optimizer must be"):
        autoshard(model, (2,), _batch(0), optimizer="lion")
    with pytest.raises(ValueError, match="memory_per_rank"):
        autoshard(model, (2,), _batch(0), memory_per_rank=-1)
    with pytest.raises(TypeError, match="model must be"):
        autoshard("model", (2,), _batch(0))
    plan = autoshard(model, (2,), _batch(0))
    with pytest.raises(ValueError, match="pass the DeviceMesh"):
        plan.apply(copy.deepcopy(model))


def test_world_of_shapes_records_what_rank_0_records() -> None:
    """Uneven redistributions on a (2, 3) mesh: rank 0 alone in a world of shapes (meta) records the
    collectives, shapes and bytes rank 0 records in the simulated world (real data)."""
    from shardtensor import Partial, Replicate, Shard, distribute_tensor
    from shardtensor.comm.shapes import ShapeTransport, run_one_rank

    moves = [([Shard(0), Shard(1)], [Replicate(), Shard(0)]), ([Partial(), Shard(0)], [Shard(1), Replicate()]),
             ([Shard(1), Replicate()], [Shard(0), Shard(1)]), ([Replicate(), Partial()], [Shard(0), Shard(0)])]

    def body(device: str) -> list[tuple]:
        mesh = init_device_mesh("cpu", (2, 3))
        seen = []
        for src, dst in moves:
            x = distribute_tensor(torch.ones(7, 5, device=device), mesh, src)
            with recording() as log:
                y = x.redistribute(mesh, dst)
            seen.append((tuple(y.to_local().shape), [(e.kind, e.shape, e.bytes_received) for e in log.events
                                                     if e.rank == 0]))
        return seen

    assert run_one_rank(body, 6, "meta") == run_spmd(body, 6, "cpu")[0]
    with pytest.raises(ValueError, match="rank must be"):
        ShapeTransport(4, 4)
