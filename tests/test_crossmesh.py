"""Moving a DTensor between two meshes (``redistribute(other_mesh, ...)``, ``shardtensor.transfer``).

Random (shape, source mesh and placements, destination mesh and placements) pairs on a simulated
world of 8 ranks: disjoint, overlapping and equal rank sets, uneven and empty shards, nested shard
orders, strided shards, Partial on either side, several dtypes.  Every pair is checked exact
against the dense tensor; its bytes on the wire against a lower bound worked out here from the
indices each rank really holds (``distribute_tensor`` of an index tensor, not the planner's boxes);
its busiest sender against the balanced optimum.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from shardtensor import DeviceMesh, Partial, Replicate, Shard, StridedShard, comm, distribute_tensor, run_spmd
from shardtensor.redistribute.move import plan_move
from shardtensor.placement import OrderedPlacements

pytestmark = pytest.mark.main_release  # our own algorithms: the main torch release runs them (tests/conftest.py)

WORLD = 8
MESH_SHAPES = [(1,), (2,), (3,), (4,), (8,), (2, 2), (2, 3), (3, 2), (2, 4), (4, 2), (1, 3), (2, 2, 2)]
DTYPES = [torch.float32, torch.float32, torch.int64, torch.bfloat16, torch.float64]


def _placements(rng: random.Random, ndim: int, mesh_ndim: int, partial: tuple[str, ...]) -> list:
    out = []
    for _ in range(mesh_ndim):
        roll = rng.random()
        if ndim and roll < 0.55:
            out.append(Shard(rng.randrange(ndim)))
        elif roll < 0.8 or not partial:
            out.append(Replicate())
        else:
            out.append(Partial(rng.choice(partial)))
    if ndim and rng.random() < 0.1:  # a strided shard comes after every Shard of its dim
        d = rng.randrange(ndim)
        j = mesh_ndim - 1
        if all(not (isinstance(p, Shard) and p.dim == d) for p in out[:j]):
            out[j] = StridedShard(d, split_factor=2)
    return out


def _order(rng: random.Random, pl: list) -> dict | None:
    """A non-default nested order for a dim sharded by several mesh dims, sometimes."""
    dims: dict[int, list[int]] = {}
    for j, p in enumerate(pl):
        if type(p) is Shard:
            dims.setdefault(p.dim, []).append(j)
    nested = {d: js for d, js in dims.items() if len(js) > 1}
    if not nested or rng.random() < 0.5:
        return None
    return {d: list(reversed(js)) if d in nested else js for d, js in dims.items()}


def _case(seed: int) -> dict:
    rng = random.Random(seed)
    ndim = rng.choice([0, 1, 2, 2, 3])
    shape = tuple(rng.choice([0, 1, 2, 3, 5, 6, 7, 9]) if rng.random() < 0.1 else rng.randint(1, 9)
                  for _ in range(ndim))
    sm, dm = rng.choice(MESH_SHAPES), rng.choice(MESH_SHAPES)
    ns, nd = math.prod(sm), math.prod(dm)
    ranks = list(range(WORLD))
    mode = rng.choice(["disjoint", "overlap", "equal", "any"])
    rng.shuffle(ranks)
    src = ranks[:ns]
    if mode == "disjoint" and ns + nd <= WORLD:
        dst = ranks[ns:ns + nd]
    elif mode == "equal" and ns == nd:
        dst = rng.sample(src, nd)
    elif mode == "overlap":
        dst = (src[:max(1, nd // 2)] + ranks[ns:])[:nd]
        dst += [r for r in ranks if r not in dst][:nd - len(dst)]
    else:
        dst = rng.sample(range(WORLD), nd)
    if dst == src and sm == dm:  # the same mesh is not a move
        dst = dst[::-1] if nd > 1 else [r for r in range(WORLD) if r != src[0]][:1]
    dtype = rng.choice(DTYPES)
    spl = _placements(rng, ndim, len(sm), ("sum",))
    dpl = _placements(rng, ndim, len(dm), ("sum", "max", "avg") if dtype.is_floating_point else ("sum", "max"))
    return dict(seed=seed, shape=shape, src=(src, sm), dst=(dst, dm), dtype=dtype, spl=spl, dpl=dpl,
                sorder=_order(rng, spl), dorder=_order(rng, dpl))


def _mesh(ranks_shape) -> DeviceMesh:
    ranks, shape = ranks_shape
    return DeviceMesh("cpu", torch.tensor(ranks).reshape(shape))


def _laid_out(dense, mesh, pl, order):
    """``dense`` distributed in ``pl`` with the shard order ``order`` (no send/recv: the moves
    the test counts are the cross-mesh ones)."""
    if order is not None:
        pl = OrderedPlacements(pl, tuple(sorted((d, tuple(js)) for d, js in order.items())))
    return distribute_tensor(dense, mesh, pl)


def _indices(x) -> set[int]:
    return set(x.to_local().reshape(-1).tolist()) if x.device_mesh.get_coordinate() is not None else set()


def _run_cases(cases: list[dict], out: dict) -> None:
    """Every rank runs every case; ``out[(seed, rank)]`` gets what the checks need."""
    me = comm.current_transport().rank
    for c in cases:
        a, b = _mesh(c["src"]), _mesh(c["dst"])
        gen = torch.Generator().manual_seed(c["seed"])
        dense = torch.randint(-4, 5, c["shape"], generator=gen).to(c["dtype"])
        x = _laid_out(dense, a, c["spl"], c["sorder"])
        y = x.redistribute(b, c["dpl"], shard_order=c["dorder"])
        with comm.scope("check"):  # not counted: only the move is
            got = y.full_tensor() if b.get_coordinate() is not None else None
        plan = plan_move(x._spec, y._spec)
        index = torch.arange(dense.numel(), dtype=torch.int64).reshape(c["shape"])
        held_pl = plan.pre if plan.pre is not None else x.placements
        held = _laid_out(index, a, [Replicate() if p.is_partial() else p for p in held_pl],
                         c["sorder"] if plan.pre is None else None)
        need = _laid_out(index, b, [Replicate() if p.is_partial() else p for p in c["dpl"]], c["dorder"])
        coord = b.get_coordinate()
        filled = coord is not None and any(coord[j] for j, p in enumerate(c["dpl"])
                                           if p.is_partial() and p.reduce_op == "sum")
        term = 0  # which term of a Partial source this rank holds, when the plan sends terms
        if plan.reduce is not None and a.get_coordinate() is not None:
            for j, p in enumerate(c["spl"]):
                if p.is_partial():
                    term = term * a.shape[j] + a.get_coordinate()[j]
        out[(c["seed"], me)] = dict(ok=got is None or torch.equal(got, dense), got=got, dense=dense, plan=plan,
                                    held=_indices(held), need=set() if filled else _indices(need),
                                    src_ranks=set(c["src"][0]), term=term)


def _lower_bound_and_optimum(seed: int, out: dict, itemsize: int, terms: int) -> tuple[int, float]:
    """Every destination byte a rank lacks, received once (per term, when the plan sends a Partial
    source's terms), and the balanced busiest sender: what each class of identical holders owes,
    over its holders."""
    held = {r: out[(seed, r)]["held"] for r in range(WORLD) if r in out[(seed, 0)]["src_ranks"]}
    need = {r: out[(seed, r)]["need"] for r in range(WORLD)}
    classes: dict[tuple, list[int]] = {}
    for r, h in held.items():
        if h:
            classes.setdefault((out[(seed, r)]["term"], frozenset(h)), []).append(r)
    lower = 0
    for t in range(terms):
        for r, n in need.items():
            mine = held.get(r, set()) if out[(seed, r)]["term"] == t else set()
            lower += len(n - mine) * itemsize
    optimum = 0.0
    for (_, h), holders in classes.items():
        owed = sum(len(n & h) for r, n in need.items() if r not in holders)
        optimum = max(optimum, owed * itemsize / len(holders))
    return lower, optimum


N_CASES = 240


@pytest.fixture(scope="module")
def random_moves():
    cases = [_case(s) for s in range(N_CASES)]
    out: dict = {}
    with comm.recording() as log:
        run_spmd(_run_cases, WORLD, cases, out)
    return cases, out, log


def test_random_moves_are_exact(random_moves):
    cases, out, _ = random_moves
    bad = [(c["seed"], r) for c in cases for r in range(WORLD) if not out[(c["seed"], r)]["ok"]]
    assert not bad, f"wrong values in (seed, rank) {bad[:10]}: {cases[bad[0][0]]}"
    kinds = {"disjoint": 0, "overlap": 0, "equal": 0}
    for c in cases:
        s, d = set(c["src"][0]), set(c["dst"][0])
        kinds["disjoint" if not s & d else "equal" if s == d else "overlap"] += 1
    assert min(kinds.values()) >= 20, kinds
    assert sum(any(p.is_partial() for p in c["spl"]) for c in cases) >= 20
    plans = [out[(c["seed"], 0)]["plan"] for c in cases]
    assert sum(p.reduce is not None for p in plans) >= 20 and sum(p.pre is not None for p in plans) >= 5
    assert sum(any(p.is_partial() for p in c["dpl"]) for c in cases) >= 20
    assert sum(any(isinstance(p, StridedShard) for p in c["spl"] + c["dpl"]) for c in cases) >= 5
    assert sum(c["sorder"] is not None or c["dorder"] is not None for c in cases) >= 10


def test_random_moves_send_the_lower_bound_balanced(random_moves):
    cases, out, log = random_moves
    total_planned = 0
    for c in cases:
        plan = out[(c["seed"], 0)]["plan"]
        lower, optimum = _lower_bound_and_optimum(c["seed"], out, plan.itemsize, plan.terms)
        assert plan.total_bytes == lower, (c, plan.describe())
        assert plan.busiest_sender <= max(1.1 * optimum, optimum + plan.itemsize), (c, plan.describe(), optimum)
        assert plan.optimum == pytest.approx(optimum), (c, plan.describe(), optimum)
        total_planned += plan.total_bytes
    on_wire = sum(e.bytes_sent for e in log.events if e.kind == "send_recv" and "check" not in e.scope)
    assert on_wire == total_planned > 0


def _partial_body(n, dst_pl):
    a, b = DeviceMesh("cpu", [0, 1, 2, 3]), DeviceMesh("cpu", [4, 5, 6, 7])
    dense = torch.arange(n * n, dtype=torch.float32).reshape(n, n) % 7
    x = distribute_tensor(dense, a, [Partial()])
    y = x.redistribute(b, dst_pl)
    return plan_move(x._spec, y._spec), torch.equal(y.full_tensor(), dense) if b.get_coordinate() is not None else None


def test_partial_source_is_reduced_where_it_is_cheapest():
    # to shards on other ranks: sending the 4 terms costs each rank what a reduce-scatter and a
    # copy would, in one stage instead of two
    res = run_spmd(_partial_body, WORLD, 8, [Shard(0)])
    plan = res[0][0]
    assert plan.pre is None and plan.reduce == "sum" and plan.terms == 4
    assert plan.total_bytes == 4 * 64 * 4 and all(r[1] for r in res[4:])
    # to 4 replicas of 4 MiB: every receiver would take 4 terms; a reduce-scatter first sends one copy
    res = run_spmd(_partial_body, WORLD, 1024, [Replicate()])
    plan = res[0][0]
    assert plan.reduce is None and isinstance(plan.pre[0], Shard)
    assert plan.total_bytes == 4 * 1024 * 1024 * 4 and all(r[1] for r in res[4:])


def _grad_body(dst_ranks):
    a = DeviceMesh("cpu", [[0, 1], [2, 3]])
    b = DeviceMesh("cpu", dst_ranks)
    g = torch.arange(35.).reshape(7, 5)
    x = distribute_tensor(g, a, [Shard(0), Shard(1)]).requires_grad_()
    y = x.redistribute(b, [Shard(1), Replicate()])
    (y * y).sum().backward()
    return x.grad.full_tensor() if a.get_coordinate() is not None else None


@pytest.mark.parametrize("dst_ranks", [[[4, 5], [6, 7]], [[3, 1], [0, 2]], [[2, 5], [6, 0]]],
                         ids=["disjoint", "same-ranks", "overlap"])
def test_gradient_moves_back(dst_ranks):
    res = run_spmd(_grad_body, WORLD, dst_ranks)
    for r in range(4):
        assert torch.equal(res[r], 2 * torch.arange(35.).reshape(7, 5))


def _state_dict_body(bucket_bytes):
    from shardtensor import transfer

    a, b = DeviceMesh("cpu", [[0, 1], [2, 3]]), DeviceMesh("cpu", [1, 4, 5])
    dense = {"w": torch.arange(48.).reshape(8, 6), "b": torch.arange(5, dtype=torch.int64),
             "h": torch.arange(24.).reshape(4, 6).to(torch.bfloat16), "s": torch.tensor(3.0)}
    pl = {"w": [Shard(0), Shard(1)], "b": [Replicate(), Shard(0)], "h": [Partial(), Shard(1)], "s": [Partial(), Replicate()]}
    src = {k: distribute_tensor(v, a, pl[k]) for k, v in dense.items()}
    with comm.recording() as log:
        moved = transfer(src, b, {"w": [Shard(1)], "b": [Replicate()], "h": [Shard(0)], "s": [Replicate()]},
                         bucket_bytes=bucket_bytes)
    out = {k: distribute_tensor(torch.zeros_like(v), b, [Shard(0)] if v.ndim else [Replicate()])
           for k, v in dense.items()}
    same = transfer(src, out=out, bucket_bytes=bucket_bytes)
    if b.get_coordinate() is None:
        return None
    messages = sum(1 for e in log.events if e.kind == "send_recv" and e.rank == comm.current_transport().rank)
    return ({k: torch.equal(v.full_tensor(), dense[k]) for k, v in moved.items()},
            {k: torch.equal(v.full_tensor(), dense[k]) for k, v in same.items()}, same is out, messages)


@pytest.mark.parametrize("bucket_bytes", [None, 40])
def test_transfer_a_state_dict(bucket_bytes):
    res = run_spmd(_state_dict_body, WORLD, bucket_bytes)
    for r in (1, 4, 5):
        moved, into, is_out, messages = res[r]
        assert all(moved.values()) and all(into.values()) and is_out, res[r]
        if bucket_bytes is None and r != 1:
            assert messages <= 2  # one exchange per call: every tensor in one bucket
    assert res[4][3] > 2 or bucket_bytes is None


def _bad_input_body(case):
    from shardtensor import transfer

    a, b = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
    x = distribute_tensor(torch.ones(4, 4), a, [Shard(0)])
    outs = {"shape": {"x": distribute_tensor(torch.ones(4, 5), b, [Shard(0)])},
            "dtype": {"x": distribute_tensor(torch.ones(4, 4, dtype=torch.float64), b, [Shard(0)])},
            "names": {"y": distribute_tensor(torch.ones(4, 4), b, [Shard(0)])}}
    calls = {"mesh": lambda: x.redistribute("cpu", [Shard(0)]), "placements": lambda: x.redistribute(b, [Shard(2)])}
    with comm.recording() as log:
        try:
            calls[case]() if case in calls else transfer({"x": x}, out=outs[case])
        except (ValueError, TypeError, IndexError) as e:
            return str(e), sum(1 for e in log.events if "move" in e.scope or "redistribute" in e.scope)
    return None


@pytest.mark.parametrize("case,words", [("shape", "shape (4, 4) in src and (4, 5)"), ("dtype", "torch.float64"),
                                        ("names", "different names"), ("mesh", "DeviceMesh"),
                                        ("placements", "Shard")])
def test_bad_input_fails_on_every_rank_before_anything_moves(case, words):
    res = run_spmd(_bad_input_body, 4, case)
    for msg, events in res:
        assert words in msg and events == 0, (msg, events)


def test_destination_mesh_outside_the_world():
    def body():
        a = DeviceMesh("cpu", [0, 1])
        x = distribute_tensor(torch.ones(4), a, [Shard(0)])
        with pytest.raises(ValueError, match="outside"):
            x.redistribute(DeviceMesh("cpu", [2, 9]), [Shard(0)])

    run_spmd(body, 4)  # DeviceMesh itself refuses it on every rank, naming the ranks


def _gloo_body(rank, world):
    from shardtensor import transfer

    a, b = DeviceMesh("cpu", [[0, 1], [2, 3]]), DeviceMesh("cpu", [3, 4, 5])
    dense = {"w": torch.arange(63.).reshape(9, 7), "p": torch.arange(10.)}
    src = {"w": distribute_tensor(dense["w"], a, [Shard(0), Shard(1)]),
           "p": distribute_tensor(dense["p"], a, [Partial(), Replicate()])}
    moved = transfer(src, b, {"w": [Shard(1)], "p": [Shard(0)]})
    back = moved["w"].redistribute(a, [Replicate(), Shard(0)])
    out = {}
    if b.get_coordinate() is not None:
        out = {k: torch.equal(v.full_tensor(), dense[k]) for k, v in moved.items()}
    if a.get_coordinate() is not None:
        out["back"] = torch.equal(back.full_tensor(), dense["w"])
    return out


@pytest.mark.skipif(not __import__("distributed").gloo_available(), reason="gloo not available")
def test_gloo_processes_move_between_meshes():
    from distributed import run_multiprocess

    res = run_multiprocess(_gloo_body, world_size=6, timeout=180)
    assert all(all(r.values()) and r for r in res), res


def test_a_missing_peer_fails_the_wait_naming_it():
    from shardtensor.errors import CollectiveTimeoutError

    def body():
        a, b = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
        x = distribute_tensor(torch.ones(4, 4), a, [Shard(0)])
        if comm.current_transport().rank != 3:  # rank 3 never takes part
            x.redistribute(b, [Shard(1)])

    with pytest.raises(CollectiveTimeoutError, match=r"ranks \[3\] never arrived"):
        run_spmd(body, 4, timeout=2)


def test_explain_a_move_and_the_plan_command(capsys):
    from shardtensor import explain_redistribute
    from shardtensor.cli import main
    from shardtensor.redistribute.explain_move import MoveExplanation

    ex = explain_redistribute((2, 2), (8, 6), "S0,S1", "S1", dst_mesh=(4,), dst_ranks=range(4, 8))
    assert isinstance(ex, MoveExplanation)
    d = ex.to_dict()
    assert d["total_bytes"] == d["lower_bound"] == sum(t["bytes"] for t in d["transfers"]) == 8 * 6 * 4
    assert d["per_rank"]["7"]["received"] == 0  # 6 columns over 4 ranks: 2, 2, 2, 0
    assert d["busiest_sender"] == d["balanced_optimum"] == 48
    same_ranks = explain_redistribute((2, 2), (8, 6), "S0,S1", "R,S1", dst_ranks=[0, 2, 1, 3])
    assert 0 < same_ranks.to_dict()["total_bytes"] < 8 * 6 * 4 * 2  # each rank keeps what it holds
    assert main(["plan", "--mesh", "2,2", "--shape", "8,6", "--src", "S0,S1", "--dst-mesh", "4",
                 "--dst-ranks", "4,5,6,7", "--dst", "S1"]) == 0
    out = capsys.readouterr().out
    assert "0 -> 4: 32 B in 1" in out and "= the lower bound" in out
    with pytest.raises(SystemExit) as e:
        main(["plan", "--mesh", "2,2", "--shape", "8,6", "--src", "S0,S1", "--dst-mesh", "4", "--dst", "S1",
              "--png", "x.png"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["plan", "--mesh", "2,2", "--shape", "8,6", "--src", "S0,S1", "--dst-mesh", "4", "--dst-ranks", "4,5",
              "--dst", "S1"])
    assert "must be 4 distinct" in capsys.readouterr().err


def _hung_peer_body(rank, world):
    import time

    a, b = DeviceMesh("cpu", [2, 3]), DeviceMesh("cpu", [0, 1])
    x = distribute_tensor(torch.ones(4, 4), a, [Shard(0)])
    if rank == 3:
        time.sleep(300)  # alive, never sends
    x.redistribute(b, [Shard(1)])


@pytest.mark.skipif(not __import__("distributed").gloo_available(), reason="gloo not available")
def test_gloo_a_peer_that_never_sends_fails_the_receivers_naming_it():
    from distributed import MultiprocessError, run_multiprocess

    with pytest.raises(MultiprocessError) as e:
        run_multiprocess(_hung_peer_body, world_size=4, timeout=120, env={"SHARDTENSOR_COMM_TIMEOUT": "5"},
                         init_timeout=120, fail_fast_grace=10)
    outcomes = {o.rank: o for o in e.value.outcomes}
    for r in (0, 1):  # the receivers end by themselves, before the default group's 120 s timeout
        assert outcomes[r].status == "error" and "a receive from rank 3" in outcomes[r].error, outcomes[r].summary()
        assert outcomes[r].seconds < 60


def _hf_body(state):
    from shardtensor import transfer

    a = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    b = DeviceMesh("cpu", [5, 6, 7])  # 3 ranks: every hidden size splits unevenly

    def trainer_layout(t):  # FSDP on dim 0, TP on the last dim where there is one
        return [Shard(0), Shard(t.ndim - 1)] if t.ndim > 1 else [Shard(0), Replicate()]

    src = {k: distribute_tensor(v, a, trainer_layout(v)) for k, v in state.items()}
    moved = transfer(src, b, {k: [Shard(v.ndim - 1)] for k, v in state.items()}, bucket_bytes=1 << 14)
    back = transfer(moved, a, {k: [Replicate(), Shard(0)] for k in state})
    out = {}
    if b.get_coordinate() is not None:
        out["moved"] = [k for k, v in moved.items() if not torch.equal(v.full_tensor(), state[k])]
    if a.get_coordinate() is not None:
        out["back"] = [k for k, v in back.items() if not torch.equal(v.full_tensor(), state[k])]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_hugging_face_state_dict_moves_exactly(dtype):
    """A state dict nobody here wrote: a tiny Llama built from a local config (no weights are
    downloaded), with odd sizes so every split is uneven."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=40, intermediate_size=44, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    res = run_spmd(_hf_body, WORLD, state)
    assert all(not bad for r in res for bad in r.values()), res
    assert sum("moved" in r for r in res) == 3 and sum("back" in r for r in res) == 4
