"""Auto-sharding: the chosen plan and every hand plan, applied to a real model, train as one device
does, and the bytes each rank receives per step are the predicted ones."""
from __future__ import annotations

import copy

import pytest
import torch

from shardtensor import run_spmd
from shardtensor.auto import autoshard
from shardtensor.comm.issue import recording
from shardtensor.examples import tiny_lm as T
from shardtensor.mesh import init_device_mesh

from distributed import gloo_available, run_multiprocess

MESHES = [((4,), ("d0",)), ((2, 2), ("dp", "tp")), ((2, 2), ("a", "b"))]


def _loss(out):
    return out.float().pow(2).mean()


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, T.VOCAB, (T.BATCH, T.SEQ), generator=torch.Generator().manual_seed(step))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return T.build_model(0)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m[0])) + "-" + ",".join(m[1]))
def test_plans_train_as_one_device_and_bytes_are_predicted(model, mesh) -> None:
    plan = autoshard(model, mesh, _batch(0), loss_fn=_loss)
    for name, priced in [("autoshard", plan.search.best), *plan.hand]:
        _check(model, priced, plan, _batch, name)
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


def test_command_line(capsys) -> None:
    from shardtensor.cli import main

    assert main(["plan", "--auto", "llama:layers=3,batch=4", "--mesh", "2,2", "--names", "dp,tp",
                 "--memory", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "layers.* (x3)" in out and "FSDP x TP" in out and "memory budget 64.00 MiB" in out
    for argv, message in [(["--auto", "bert"], "unknown model 'bert'"), (["--auto", "llama:depth=2"], "not key=value"),
                          (["--auto", "llama:layers=x"], "needs a positive integer"), (["--auto", "demo", "--memory", "lots"],
                                                                              "give bytes"),
                          ([], "--shape, --src, --dst")]:
        with pytest.raises(SystemExit) as e:
            main(["plan", "--mesh", "2,2", *argv])
        assert e.value.code == 2
        assert message in capsys.readouterr().err, argv


def test_decoder_plan_is_exact() -> None:
    """The Llama-style decoder (grouped-query attention, SwiGLU, RMSNorm): the chosen plan on
    (2, 2) trains as one device and moves the predicted bytes."""
    from shardtensor.examples.models import Decoder, parse

    _, shape = parse("llama:layers=2,vocab=64,seq=16,batch=8")
    torch.manual_seed(0)
    model = Decoder(shape)
    batch = _batch_of(shape)
    plan = autoshard(model, ((2, 2), ("dp", "tp")), batch, loss_fn=_loss)
    for name, priced in [("autoshard", plan.search.best), *[h for h in plan.hand if h[1].layout.tp is not None]]:
        _check(model, priced, plan, lambda s: _batch_of(shape, s), name)


def _batch_of(shape, step: int = 0) -> torch.Tensor:
    return torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(step))


def _reference(model, batches) -> list[float]:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    out = []
    for s in range(2):
        opt.zero_grad()
        loss = _loss(model(batches(s)))
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _train(layout, blocks, model, batches) -> tuple[list[float], int]:
    """Two AdamW steps of ``model`` under ``layout`` on this rank; its losses and rank 0's bytes of step 0."""
    mesh = init_device_mesh("cpu", layout.mesh_shape, mesh_dim_names=layout.names)
    m = layout.apply(copy.deepcopy(model), mesh, blocks)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
    losses, first = [], 0
    for s in range(2):
        opt.zero_grad()
        with recording() as log:
            loss = _loss(m(batches(s)))
            loss.backward()
            opt.step()
        if s == 0:
            first = sum(e.bytes_received for e in log.events if e.rank == 0)
        losses.append(loss.full_tensor().item())
    return losses, first


def _check(model, priced, plan, batches, name: str) -> None:
    layout = priced.layout
    world = 1
    for k in layout.mesh_shape:
        world *= k
    losses, got = run_spmd(_train, world, layout, plan.blocks, model, batches)[0]
    assert losses == pytest.approx(_reference(model, batches), rel=1e-5, abs=1e-6), name
    assert got == round(priced.cost.bytes), name


def _gloo_rank(rank: int, world: int, layout, blocks, model):
    return _train(layout, blocks, model, _batch)


@pytest.mark.main_release
@pytest.mark.skipif(not gloo_available(), reason="needs gloo")
def test_chosen_plan_in_gloo_processes(model) -> None:
    """The chosen plan and FSDP x TP on (2, 2) in 4 gloo processes: losses as one device, rank 0's
    bytes the predicted ones."""
    plan = autoshard(model, ((2, 2), ("dp", "tp")), _batch(0), loss_fn=_loss)
    ref = _reference(model, _batch)
    for name, priced in [("autoshard", plan.search.best), *[h for h in plan.hand if h[0] == "FSDP x TP"]]:
        res = run_multiprocess(_gloo_rank, 4, timeout=180, args=(priced.layout, plan.blocks, model))
        for losses, _ in res:
            assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6), name
        assert res[0][1] == round(priced.cost.bytes), name


def test_uneven_batch_rows_follow_the_output_placements(model) -> None:
    """6 rows over two batch dims of 2: each rank's rows are those ``(Shard(0), Shard(0))`` gives it
    (2, 1, 2, 1), not a flat split into 4 (2, 2, 2, 0), so the global output is right; every plan
    trains as one device with the predicted bytes."""
    def six(step: int) -> torch.Tensor:
        return _batch(step)[:6]

    plan = autoshard(model, ((2, 2), ("a", "b")), six(0), loss_fn=_loss)
    for name, priced in [("autoshard", plan.search.best), *plan.hand]:
        _check(model, priced, plan, six, name)


def test_comm_time_uses_the_link_of_the_dims_a_group_spans() -> None:
    """A collective on a sub-mesh or a flattened mesh reports ``mesh_dim`` 0 of that mesh; its time
    takes the link of the root mesh's dims its group spans, with the planner's ring passes."""
    from shardtensor.auto.measure import comm_seconds
    from shardtensor.comm.issue import CommEvent
    from shardtensor.redistribute.cost import LinkModel

    fast, slow = LinkModel(alpha=1e-6, beta=1e-12, launch=1e-5), LinkModel(alpha=1e-4, beta=1e-9, launch=1e-3)
    links, shape = (slow, fast), (2, 2)

    def event(kind: str, group: tuple[int, ...]) -> CommEvent:
        return CommEvent(kind, 0, 0, group, 1000, 1000, torch.float32, (250,), 0.0, "shapes")

    assert comm_seconds([event("all_gather", (0, 1))], links, shape) == pytest.approx(1e-5 + 1e-6 + 1e-9)
    assert comm_seconds([event("all_gather", (0, 2))], links, shape) == pytest.approx(1e-3 + 1e-4 + 1e-6)
    assert comm_seconds([event("all_reduce", (0, 1))], links, shape) == pytest.approx(1e-5 + 2e-6 + 1e-9)
    assert comm_seconds([event("all_gather", (0, 1, 2, 3))], links, shape) == pytest.approx(1e-3 + 3e-4 + 1e-6)
