"""RaggedShard: per-rank pieces of chosen sizes, against dense single-device torch; every
redistribution to and from it exact and at the byte lower bound."""
from __future__ import annotations

import contextlib
import io
import random

import re

import pytest
import torch

from shardtensor import (DTensor, Partial, RaggedShard, Replicate, Shard, StridedShard, distribute_tensor,
                         init_device_mesh, run_spmd, visualize_sharding)
from shardtensor.comm import recording, scope

from distributed import gloo_available

pytestmark = pytest.mark.main_release  # our own algorithms: the main torch release runs them (tests/conftest.py)


@pytest.mark.parametrize("units", [(1, 2, 1, 1), (3, 0, 1), (1,), (5, 7), (0, 0, 2, 1, 1)])
@pytest.mark.parametrize("length", [0, 1, 5, 20, 23, 64])
def test_pieces_follow_the_documented_rule(units, length):
    p = RaggedShard(0, units)
    k, total = len(units), sum(units)
    pieces = [p.pieces(length, k, r)[0] for r in range(k)]
    at = 0
    for r, (size, off) in enumerate(pieces):  # in rank order they make the tensor
        assert off == at and size >= 0
        at += size
        place = length * sum(units[:r + 1]) / total  # each boundary within one element of its place
        assert abs(at - place) < 1 and (length % total or at == place)
    assert at == length
    if units == (1, 2, 1, 1) and length == 20:
        assert pieces == [(4, 0), (8, 4), (4, 12), (4, 16)]


def test_a_unit_of_zero_holds_nothing_and_every_op_still_runs():
    x = torch.arange(12.0).reshape(6, 2)

    def rank():
        mesh = init_device_mesh("cpu", (3,))
        d = distribute_tensor(x, mesh, [RaggedShard(0, (2, 0, 1))])
        y = (d * 3).redistribute(mesh, [Shard(1)])
        return tuple(d.to_local().shape), torch.equal(y.full_tensor(), x * 3)

    assert run_spmd(rank, 3) == [((4, 2), True), ((0, 2), True), ((2, 2), True)]


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="local_units"):
        RaggedShard(0, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="local_units entry"):
        RaggedShard(0, (1, 2.5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        RaggedShard(0, (1, -1))
    with pytest.raises(ValueError, match="positive sum"):
        RaggedShard(0, (0, 0))
    with pytest.raises(TypeError, match="dim"):
        RaggedShard("0", (1,))  # type: ignore[arg-type]

    def rank():
        mesh = init_device_mesh("cpu", (4,))
        errors = []
        for bad in ([RaggedShard(0, (1, 2))], [RaggedShard(2, (1, 1, 1, 1))]):
            try:
                distribute_tensor(torch.zeros(8, 2), mesh, bad)
            except ValueError as e:
                errors.append(str(e))
        me = mesh.get_rank()
        try:  # rank 2 holds a piece one row too long
            DTensor.from_local(torch.zeros(3 if me == 2 else 2, 2), mesh, [RaggedShard(0, (1, 1, 1, 1))], shape=(8, 2))
        except ValueError as e:
            errors.append(str(e))
        return errors

    for errors in run_spmd(rank, 4):
        assert "one local unit per rank" in errors[0]
        assert "out of range" in errors[1]
        assert "rank 2: local (3, 2), expected (2, 2)" in errors[2]


def test_from_local_takes_the_pieces_as_they_are():
    x = torch.arange(40.0).reshape(20, 2)
    bounds = [0, 4, 12, 16, 20]

    def rank():
        mesh = init_device_mesh("cpu", (4,))
        r = mesh.get_rank()
        piece = x[bounds[r]:bounds[r + 1]]
        d = DTensor.from_local(piece, mesh, [RaggedShard(0, (1, 2, 1, 1))])  # the sizes are gathered
        e = DTensor.from_local(piece, mesh, [RaggedShard(0, (1, 2, 1, 1))], shape=(20, 2), run_check=False)
        return tuple(d.shape), torch.equal(d.full_tensor(), x), torch.equal(e.full_tensor(), x)

    assert run_spmd(rank, 4) == [((20, 2), True, True)] * 4


MESHES = [(4,), (2, 2), (3,), (2, 3)]


def _random_placements(rng: random.Random, ndim: int, mesh_shape: tuple[int, ...], partial: bool) -> list:
    out = []
    for k in mesh_shape:
        roll = rng.random()
        if roll < 0.4:
            out.append(RaggedShard(rng.randrange(ndim), [rng.randrange(0, 4) for _ in range(k - 1)] + [rng.randrange(1, 4)]))
        elif roll < 0.65:
            out.append(Shard(rng.randrange(ndim)))
        elif roll < 0.85 or not partial:
            out.append(Replicate())
        else:
            out.append(Partial())
    if rng.random() < 0.15 and len(mesh_shape) > 1 and not any(p.tensor_dim() == 1 for p in out):
        out[-1] = StridedShard(1, 2)
    return out


def _case(seed: int) -> dict:
    rng = random.Random(seed)
    mesh = rng.choice(MESHES)
    shape = tuple(rng.choice([1, 3, 6, 7, 10, 13]) for _ in range(2))
    src = _random_placements(rng, 2, mesh, partial=True)
    dst = _random_placements(rng, 2, mesh, partial=False)
    if not any(isinstance(p, RaggedShard) for p in src + dst):
        (src if rng.random() < 0.5 else dst)[0] = RaggedShard(0, [rng.randrange(1, 4) for _ in range(mesh[0])])
    return dict(seed=seed, mesh=mesh, shape=shape, src=src, dst=dst)


CASES = [_case(s) for s in range(120)]


def _run(cases: list[dict], world: int, out: dict) -> None:
    for c in cases:
        n = 1
        for k in c["mesh"]:
            n *= k
        if n != world:
            continue
        mesh = init_device_mesh("cpu", c["mesh"])
        dense = torch.randn(c["shape"], dtype=torch.float64, generator=torch.Generator().manual_seed(c["seed"]))
        src_pl = [Replicate() if p.is_partial() else p for p in c["src"]]
        x = distribute_tensor(dense, mesh, src_pl)
        if any(p.is_partial() for p in c["src"]):  # terms that add up to the value
            me = mesh.get_coordinate()
            scale = 1.0
            for j, p in enumerate(c["src"]):
                if p.is_partial():
                    scale *= (me[j] + 1) / (mesh.shape[j] * (mesh.shape[j] + 1) / 2)
            x = DTensor.from_local(x.to_local() * scale, mesh, c["src"], shape=dense.shape, stride=dense.stride())
        with scope(f"case {c['seed']}"):
            y = x.redistribute(mesh, c["dst"])
        want = distribute_tensor(dense, mesh, c["dst"])
        index = torch.arange(dense.numel()).reshape(c["shape"])
        held = distribute_tensor(index, mesh, src_pl).to_local()
        need = distribute_tensor(index, mesh, c["dst"]).to_local()
        out[(c["seed"], mesh.get_rank())] = dict(
            exact=torch.allclose(y.to_local(), want.to_local(), rtol=0, atol=1e-12) and y.placements == want.placements,
            lacks=len(set(need.reshape(-1).tolist()) - set(held.reshape(-1).tolist())) * 8,
            needs=need.numel() * 8)


@pytest.fixture(scope="module")
def round_trips():
    out: dict = {}
    with recording() as log:
        for world in (3, 4, 6):
            run_spmd(_run, world, CASES, world, out)
    got: dict = {}
    for e in log.events:
        for s in e.scope:
            if s.startswith("case "):
                key = (int(s[5:]), e.rank)
                got[key] = got.get(key, 0) + e.bytes_received
    return out, got


def test_random_redistributions_with_ragged_shards_are_exact(round_trips):
    out, _ = round_trips
    assert len({s for s, _ in out}) == len(CASES)
    bad = [CASES[s] for (s, r), o in out.items() if not o["exact"]]
    assert not bad, bad[:3]
    kinds = [(len(c["mesh"]), any(p.is_partial() for p in c["src"]),
              any(isinstance(p, StridedShard) for p in c["src"] + c["dst"])) for c in CASES]
    assert sum(k[0] == 2 for k in kinds) >= 40 and sum(k[1] for k in kinds) >= 10 and sum(k[2] for k in kinds) >= 5
    nested = [c for c in CASES if len({p.tensor_dim() for p in c["src"]} - {None}) < sum(
        p.tensor_dim() is not None for p in c["src"])]
    assert len(nested) >= 5  # two mesh dims splitting one tensor dim


def test_random_redistributions_receive_only_what_each_rank_lacks(round_trips):
    """Without a Partial source every rank receives exactly the elements it lacks (the lower
    bound); with one, the busiest rank receives no more than its terms of what it needs."""
    out, got = round_trips
    for c in CASES:
        ranks = [r for s, r in out if s == c["seed"]]
        received = {r: got.get((c["seed"], r), 0) for r in ranks}
        if any(p.is_partial() for p in c["src"]):
            terms = 1
            for k, p in zip(c["mesh"], c["src"]):
                terms *= k if p.is_partial() else 1
            bound = max((terms - 1) * out[(c["seed"], r)]["needs"] + out[(c["seed"], r)]["lacks"] for r in ranks)
            assert max(received.values()) <= bound, (c, received, bound)
        else:
            assert received == {r: out[(c["seed"], r)]["lacks"] for r in ranks}, c


def test_elementwise_ops_and_an_optimizer_step_keep_the_layout():
    w0 = torch.randn(10, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g0 = torch.randn(10, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = torch.nn.Parameter(w0.clone())
    ref.grad = g0.clone()
    opt = torch.optim.AdamW([ref], lr=0.1, foreach=True)
    opt.step()
    torch.nn.utils.clip_grad_norm_([ref], 0.5)

    def rank():
        mesh = init_device_mesh("cpu", (4,))
        pl = [RaggedShard(0, (3, 1, 0, 1))]
        w = torch.nn.Parameter(distribute_tensor(w0, mesh, pl))
        w.grad = distribute_tensor(g0, mesh, pl)
        opt = torch.optim.AdamW([w], lr=0.1, foreach=True)
        with recording() as log:
            opt.step()
        step_bytes = sum(e.bytes_received for e in log.events if e.rank == mesh.get_rank())
        with recording() as log:
            norm = torch.nn.utils.clip_grad_norm_([w], 0.5)
        clip_bytes = sum(e.bytes_received for e in log.events if e.rank == mesh.get_rank())
        assert 0 < clip_bytes <= 64, clip_bytes  # local norms, one scalar reduced: no gradient moves
        return (w.placements == tuple(pl), opt.state[w]["exp_avg"].placements == tuple(pl), step_bytes,
                torch.allclose(w.full_tensor(), ref.detach()), torch.allclose(w.grad.full_tensor(), ref.grad),
                float(norm.full_tensor() if isinstance(norm, DTensor) else norm))

    want_norm = float(torch.linalg.vector_norm(g0))
    for same, state_same, step_bytes, w_ok, g_ok, norm in run_spmd(rank, 4):
        assert same and state_same and step_bytes == 0 and w_ok and g_ok
        assert norm == pytest.approx(want_norm)


def test_nested_with_a_shard_on_a_two_dim_mesh():
    x = torch.arange(26.0 * 3).reshape(26, 3)

    def rank():
        mesh = init_device_mesh("cpu", (2, 2))
        out = []
        for pl in ([Shard(0), RaggedShard(0, (3, 1))], [RaggedShard(0, (1, 3)), Shard(0)],
                   [RaggedShard(0, (1, 1)), RaggedShard(1, (2, 1))]):
            d = distribute_tensor(x, mesh, pl)
            size, off = d._spec.local_shape_and_offset()
            local_ok = torch.equal(d.to_local(), x[off[0]:off[0] + size[0], off[1]:off[1] + size[1]])
            out.append((size, local_ok, torch.equal(d.full_tensor(), x),
                        torch.equal(d.redistribute(mesh, [Shard(1), Replicate()]).full_tensor(), x)))
        return out

    res = run_spmd(rank, 4)
    assert all(ok for r in res for _, *oks in r for ok in oks)
    # (S0, RS0(3:1)): each half of 13 rows, then 3/4 and 1/4 of it
    assert [r[0][0] for r in res] == [(9, 3), (4, 3), (9, 3), (4, 3)]
    # (RS0(1:3), S0): 6 and 20 rows, then halves
    assert [r[1][0] for r in res] == [(3, 3), (3, 3), (10, 3), (10, 3)]


def test_visualize_sharding_draws_each_piece(capsys):
    def rank():
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(torch.zeros(20, 2), mesh, [RaggedShard(0, (1, 2, 1, 1))])
        visualize_sharding(d)

    run_spmd(rank, 4)
    text = capsys.readouterr().out
    assert "RS(0,1:2:1:1)" in text or "RaggedShard" in text
    for rows in ("0:4", "4:12", "12:16", "16:20"):
        assert rows in text, text


def test_shardtensor_plan_prints_the_block_exchange():
    from shardtensor.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", "--mesh", "4", "--shape", "20,8", "--src", "RS(0,1:2:1:1)", "--dst", "S0"]) == 0
    text = buf.getvalue()
    assert "total 128 B on the wire (= the lower bound" in text  # rows 4, 10, 11 and 15 move: 8 columns of 4 B
    assert "1 -> 0: 32 B" in text and "2 -> 3: 32 B" in text


def test_the_muon_example_in_the_simulated_world(capsys):
    from shardtensor.examples.muon import main

    assert main("sim", steps=2) == 0
    out = capsys.readouterr().out
    assert "every weight equal to one device's Muon training" in out and "bytes at the lower bound on every rank" in out
    # whole parameters per rank: the step moves nothing, and FSDP's collectives move what Shard(0)'s do
    assert out.count("the Muon moves received 0 B") == 4
    fsdp = re.findall(r"FSDP's all-gathers and reduce-scatters (\d+) B", out)
    assert len(fsdp) == 8 and len(set(fsdp)) == 1, fsdp


@pytest.mark.skipif(not gloo_available(), reason="gloo not available")
def test_the_muon_example_in_gloo_processes(capsys):
    from shardtensor.examples.muon import main

    assert main("gloo", steps=2) == 0
    out = capsys.readouterr().out
    assert "every weight equal to one device's Muon training" in out and "bytes at the lower bound on every rank" in out


@pytest.mark.parametrize("ord", [2.0, 1.0, 3.0, float("inf"), float("-inf"), 0.0])
def test_sums_and_norms_of_every_element_move_no_data(ord):
    x = torch.randn(9, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def rank():
        mesh = init_device_mesh("cpu", (2, 2))
        out = []
        for units in ((2, 1), (1, 0)):  # (1, 0): an empty piece (an infinite norm then gathers: exact either way)
            d = distribute_tensor(x, mesh, [RaggedShard(0, units), Shard(1)])
            with recording() as log:
                n = torch.linalg.vector_norm(d, ord)
                s = d.sum()
                fn = torch._foreach_norm([d, d * 2], ord)
            moved = sum(e.bytes_received for e in log.events if e.rank == mesh.get_rank() and e.kind != "all_reduce")
            out.append((moved, float(n.full_tensor()), float(s.full_tensor()), [float(v.full_tensor()) for v in fn]))
        return out

    want_n = float(torch.linalg.vector_norm(x, ord))
    for r in run_spmd(rank, 4):
        for units, (moved, n, s, fn) in zip(((2, 1), (1, 0)), r):
            assert n == pytest.approx(want_n) and s == pytest.approx(float(x.sum()))
            assert fn == pytest.approx([want_n, float(torch.linalg.vector_norm(x * 2, ord))])
            if units == (2, 1) or ord not in (float("inf"), float("-inf")):
                assert moved == 0


def test_gradients_flow_back_through_a_redistribution():
    x = torch.randn(11, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    w = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    ref = x.clone().requires_grad_()
    (ref.sin() @ w).square().sum().backward()

    def rank():
        mesh = init_device_mesh("cpu", (2, 2))
        pl = [RaggedShard(0, (3, 1)), RaggedShard(0, (1, 2))]
        d = distribute_tensor(x, mesh, pl).requires_grad_()
        y = d.sin().redistribute(mesh, [Shard(0), Replicate()]) @ distribute_tensor(w, mesh, [Replicate()] * 2)
        y.square().sum().backward()
        return d.grad.placements == tuple(pl), torch.allclose(d.grad.full_tensor(), ref.grad)

    assert run_spmd(rank, 4) == [(True, True)] * 4


_ALONG_CASES = [  # (name, op on a (7, 5, 6) tensor, a dim it reduces or scans)
    ("sum", lambda t: t.sum(2), 2), ("sum keepdim", lambda t: t.sum((1, -1), keepdim=True), 1),
    ("mean", lambda t: t.mean(1), 1), ("amax", lambda t: t.amax(-1), 2), ("amin", lambda t: t.amin((1, 2)), 1),
    ("prod", lambda t: t.prod(2), 2), ("var", lambda t: t.var(1, correction=0), 1), ("std", lambda t: t.std(2), 2),
    ("norm", lambda t: torch.linalg.vector_norm(t, 3.0, dim=1), 1), ("logsumexp", lambda t: t.logsumexp(2), 2),
    ("argmax", lambda t: t.argmax(1), 1), ("any", lambda t: (t > 1).any(2), 2),
    ("cumsum", lambda t: t.cumsum(1), 1), ("softmax", lambda t: t.softmax(-1), 2),
    ("log_softmax", lambda t: t.log_softmax(1), 1),
]


@pytest.mark.parametrize("name,op,dim", _ALONG_CASES, ids=[c[0] for c in _ALONG_CASES])
def test_reductions_along_unsplit_dims_keep_the_layout_and_move_nothing(name, op, dim):
    """Each rank's pieces hold whole rows along the reduced dims: the op runs on them as they are."""
    x = torch.randn(7, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    want = op(x)

    def rank():
        out = []
        for shape, pl in (((4,), [RaggedShard(0, (3, 0, 1, 2))]),
                          ((2, 2), [RaggedShard(0, (1, 2)), StridedShard(0 if dim else 1, 2)]),
                          ((2, 2), [Shard(0), RaggedShard(0, (2, 1))])):
            mesh = init_device_mesh("cpu", shape)
            d = distribute_tensor(x, mesh, pl)
            if any(p.tensor_dim() == dim for p in d.placements):
                continue
            with recording() as log:
                y = op(d)
            moved = sum(e.bytes_received for e in log.events if e.rank == mesh.get_rank())
            out.append((moved, [p.tensor_dim() for p in y.placements], y.dtype == want.dtype,
                        torch.allclose(y.full_tensor(), want) if want.is_floating_point()
                        else torch.equal(y.full_tensor(), want)))
        return out

    for r in run_spmd(rank, 4):
        assert r and all(moved == 0 and same_dtype and ok for moved, _, same_dtype, ok in r), r
        assert all(dims[0] == 0 for _, dims, _, _ in r)  # the ragged dim 0 stays dim 0 (only later dims go)


def test_a_reduction_along_a_split_dim_gathers_and_is_exact():
    x = torch.randn(9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        d = distribute_tensor(x, mesh, [RaggedShard(1, (3, 1))])
        y = d.sum(0)  # dim 0 is whole on every rank: the ragged dim 1 becomes dim 0
        z = d.sum(1)  # along the ragged dim: gathered first
        w = distribute_tensor(x3, mesh, [StridedShard(2, 2)]).amax((0, 1))  # packed dim 2 becomes dim 0
        return y.placements == (RaggedShard(0, (3, 1)),), torch.allclose(y.full_tensor(), x.sum(0)), \
            torch.allclose(z.full_tensor(), x.sum(1)), w.placements == (StridedShard(0, 2),), \
            torch.equal(w.full_tensor(), x3.amax((0, 1)))

    x3 = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(15))
    assert run_spmd(rank, 2) == [(True,) * 5] * 2


def test_gradients_through_reductions_along_unsplit_dims():
    """Backward mixes the layout with replicated gradients (a whole sum's); each rank cuts its
    piece of them, so a 1-row piece never broadcasts against the whole gradient."""
    x = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    losses = (lambda t: t.log_softmax(1).sum(1).square().sum(), lambda t: t.amax(1).sum(),
              lambda t: (t.softmax(-1) * t).sum(), lambda t: t.cumsum(1).square().mean())
    refs = []
    for loss in losses:
        ref = x.clone().requires_grad_()
        loss(ref).backward()
        refs.append(ref.grad)

    def rank():
        mesh = init_device_mesh("cpu", (4,))
        pl = [RaggedShard(0, (1, 3, 0, 2))]
        out = []
        for loss, want in zip(losses, refs):
            d = distribute_tensor(x, mesh, pl).requires_grad_()
            loss(d).backward()
            out.append(torch.allclose(d.grad.full_tensor(), want))
        return out

    assert run_spmd(rank, 4) == [[True] * len(losses)] * 4


def test_a_replicated_operand_is_cut_to_the_layout():
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    r = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(12))

    def rank():
        mesh = init_device_mesh("cpu", (2, 2))
        pl = [RaggedShard(0, (1, 3)), StridedShard(1, 2)]
        d, rep = distribute_tensor(x, mesh, pl), distribute_tensor(r, mesh, [Replicate(), Replicate()])
        with recording() as log:
            y = d * rep + rep.sin()
            z = torch._foreach_add([d, d * 2], [rep, rep])
            d2 = d.clone()
            d2.copy_(rep)
        moved = sum(e.bytes_received for e in log.events if e.rank == mesh.get_rank())
        return (moved, y.placements == tuple(pl), torch.allclose(y.full_tensor(), x * r + r.sin()),
                [torch.allclose(v.full_tensor(), w) for v, w in zip(z, (x + r, 2 * x + r))],
                d2.placements == tuple(pl) and torch.equal(d2.full_tensor(), r))

    assert run_spmd(rank, 4) == [(0, True, True, [True, True], True)] * 4


def test_an_in_place_op_on_a_replicated_tensor_is_not_cut():
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    r = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(14))

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        d, rep = distribute_tensor(x, mesh, [RaggedShard(0, (1, 2))]), distribute_tensor(r, mesh, [Replicate()])
        rep.add_(d)
        torch._foreach_mul_([rep], [d])
        return rep.placements == (Replicate(),), torch.allclose(rep.full_tensor(), (r + x) * x)

    assert run_spmd(rank, 2) == [(True, True)] * 2
