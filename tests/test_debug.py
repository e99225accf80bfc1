"""shardtensor.debug: CommTrace (bytes, attribution, outputs), visualize_sharding, DispatchProfile and
cache_stats, and the docs' examples."""
from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh, run_spmd
from shardtensor.debug import (CommTrace, DispatchProfile, cache_stats, describe_sharding, name_modules,
                               visualize_sharding)
from shardtensor.spec import DTensorSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()


# -- byte counts against the ring model of docs/redistribution.md -------------------------------

def _source(mesh, shape, placements):
    """A DTensor of ones with ``placements`` (Partial sources via from_local)."""
    if any(isinstance(p, Partial) for p in placements):
        local_shape = DTensorSpec.build(mesh, placements, shape, None, torch.float32).local_shape
        return DTensor.from_local(torch.ones(local_shape), mesh, placements, shape=shape)
    return distribute_tensor(torch.ones(shape), mesh, placements)


def _nbytes(*shape: int) -> int:
    n = 4  # float32
    for s in shape:
        n *= s
    return n


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# (mesh, global shape, source, target, kind, mesh dim, group size, bytes sent per rank by the model)
# q_d = ceil(l_d / k) / l_d; all-gather and reduce-scatter (k-1) q |X|; all-reduce 2 (k-1)/k |X|;
# all-to-all (k-1) q_a q_b |X|.  |X| is the step's logical shape.
BYTE_CASES = {
    "S0->R even": ((4,), (8, 16), [S0], [R], "all_gather", 0, 4, 3 * _nbytes(8, 16) // 4),
    "S0->R uneven": ((4,), (7, 16), [S0], [R], "all_gather", 0, 4, 3 * _ceil(7, 4) * _nbytes(16)),
    "P->R": ((4,), (8, 16), [P], [R], "all_reduce", 0, 4, 2 * 3 * _nbytes(8, 16) // 4),
    "P->S0 even": ((4,), (8, 16), [P], [S0], "reduce_scatter", 0, 4, 3 * _nbytes(8, 16) // 4),
    "P->S0 uneven": ((4,), (7, 16), [P], [S0], "reduce_scatter", 0, 4, 3 * _ceil(7, 4) * _nbytes(16)),
    "S0->S1 even": ((4,), (8, 16), [S0], [S1], "all_to_all", 0, 4, 3 * _nbytes(8, 16) // 16),
    # (7, 6) on 4 ranks, one 2x2 block to each peer
    "S0->S1 uneven": ((4,), (7, 6), [S0], [S1], "all_to_all", 0, 4, 3 * _nbytes(2, 2)),
    # 2-D mesh: the mesh-dim-0 group sees the logical shape (8, 4) (mesh dim 1 still splits dim 1)
    "(S0,S1)->(R,S1)": ((2, 2), (8, 8), [S0, S1], [R, S1], "all_gather", 0, 2, 1 * _nbytes(8, 4) // 2),
    # all-reduce on mesh dim 0 of the logical (4, 8) piece
    "(P,S0)->(R,S0)": ((2, 2), (8, 8), [P, S0], [R, S0], "all_reduce", 0, 2, 2 * 1 * _nbytes(4, 8) // 2),
    # reduce-scatter on mesh dim 1 of the logical (8, 8) value: 7 rows -> (k-1) * 4 rows
    "(R,P)->(R,S0) uneven": ((2, 2), (7, 8), [R, P], [R, S0], "reduce_scatter", 1, 2, 1 * 4 * _nbytes(8)),
}


@pytest.mark.parametrize("case", list(BYTE_CASES))
def test_trace_bytes_match_model(case):
    mesh_shape, shape, src, dst, kind, mesh_dim, k, expected = BYTE_CASES[case]

    def fn():
        mesh = init_device_mesh("cpu", mesh_shape)
        x = _source(mesh, shape, src)
        y = x.redistribute(mesh, dst)
        return y.placements

    with CommTrace() as trace, comm.recording() as log:
        run_spmd(fn, 4)
    evs = [e for e in trace.events if e.scope == ("redistribute",)]
    assert len(evs) == 4, [(e.kind, e.rank, e.scope) for e in trace.events]
    assert sorted(e.rank for e in evs) == [0, 1, 2, 3]
    for e in evs:
        assert (e.kind, e.mesh_dim, e.group_size, e.dtype) == (kind, mesh_dim, k, torch.float32)
        assert e.bytes_sent == expected and e.bytes_received == expected, (e, expected)
        assert e.backend == "simulated" and e.seconds >= 0
    # the trace sees exactly what the comm layer's own recorder sees
    assert sorted(map(repr, trace.events)) == sorted(map(repr, log.events))
    totals = trace.group("kind")[(kind,)]
    assert totals["count"] == 4 and totals["bytes_sent"] == 4 * expected


def test_trace_broadcast_and_barrier_bytes():
    def fn():
        mesh = init_device_mesh("cpu", (4,))
        comm.broadcast(torch.ones(8, 16), 0, mesh, 0)
        comm.barrier(mesh)

    with CommTrace() as trace:
        run_spmd(fn, 4)
    bc = {e.rank: e for e in trace.events if e.kind == "broadcast"}
    assert (bc[0].bytes_sent, bc[0].bytes_received) == (3 * _nbytes(8, 16), 0)
    for r in (1, 2, 3):
        assert (bc[r].bytes_sent, bc[r].bytes_received) == (0, _nbytes(8, 16))
    barriers = [e for e in trace.events if e.kind == "barrier"]
    assert len(barriers) == 4 and all(e.bytes_sent == e.bytes_received == 0 for e in barriers)


def test_trace_only_inside_and_rank_filter():
    def fn():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.ones(8, 4), mesh, [S0])
        x.full_tensor()                                    # before the trace: not recorded
        with CommTrace(rank=mesh.get_rank()) as t:         # one trace per rank, own events only
            x.full_tensor()
        x.full_tensor()                                    # after: not recorded
        return [(e.kind, e.rank) for e in t.events]

    out = run_spmd(fn, 4)
    assert out == [[("all_gather", r)] for r in range(4)]


def test_trace_op_scope_from_dispatch():
    def fn():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.ones(8, 8), mesh, [S0])
        y = distribute_tensor(torch.ones(8, 8), mesh, [S1])
        with CommTrace(rank=mesh.get_rank()) as t:
            x + y                                          # one operand moves: all-to-all
        return [e.scope for e in t.events]

    for scopes in run_spmd(fn, 4):
        assert scopes and all(s[-1] == "aten.add.Tensor" for s in scopes), scopes


# -- module attribution ----------------------------------------------------------------------

class Gather(torch.nn.Module):
    def forward(self, x):
        return x.redistribute(x.device_mesh, [Replicate()])


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gather = Gather()

    def forward(self, x):
        return self.gather(x) * 2


class Exploding(torch.nn.Module):
    def forward(self, x):
        x.redistribute(x.device_mesh, [Replicate()])
        raise ValueError("boom")


def _global_hook_counts():
    from torch.nn.modules import module as M

    return len(M._global_forward_pre_hooks), len(M._global_forward_hooks)


def test_module_attribution_class_names():
    before = _global_hook_counts()

    def fn():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.ones(8, 4), mesh, [S0])
        Gather()(x)
        Block()(x)

    with CommTrace() as trace:
        assert _global_hook_counts() == (before[0] + 1, before[1] + 1)
        run_spmd(fn, 4)
    assert _global_hook_counts() == before
    scopes = sorted({e.scope for e in trace.events if e.kind == "all_gather"})
    assert scopes == [("Block", "Gather", "redistribute"), ("Gather", "redistribute")]
    assert "Gather" in trace.module_labels and "redistribute" not in trace.module_labels
    text = trace.summary()
    assert "Block / Gather / redistribute" in text and "Gather / redistribute" in text
    assert "Block/Gather" in trace.summary(by=["modules"])


def test_module_attribution_qualified_names_and_nested_traces():
    def fn():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.ones(8, 4), mesh, [S0])
        model = torch.nn.Sequential(Block())
        name_modules(model)
        with CommTrace(rank=mesh.get_rank()) as t:         # four traces at once: hooks installed once
            model(x)
        return [e.scope for e in t.events]

    before = _global_hook_counts()
    for scopes in run_spmd(fn, 4):
        assert scopes == [("Sequential", "0", "0.gather", "redistribute")]
    assert _global_hook_counts() == before


def test_module_attribution_survives_exceptions():
    def fn():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.ones(8, 4), mesh, [S0])
        with CommTrace(rank=mesh.get_rank()) as t:
            try:
                Exploding()(x)
            except ValueError:
                pass
            left = comm.current_scope()
            x.full_tensor()                                # must not be attributed to Exploding
        return left, [e.scope for e in t.events], comm.current_scope()

    for left, scopes, after in run_spmd(fn, 4):
        assert left == () and after == ()
        assert scopes == [("Exploding", "redistribute"), ("redistribute",)]


def test_trace_ending_while_another_rank_runs_a_module():
    """The last trace ends while rank 1 is inside a module: rank 1's scope still closes."""
    import threading
    import time

    inside, trace_done = threading.Event(), threading.Event()

    class Slow(torch.nn.Module):
        def forward(self, x):
            inside.set()
            assert trace_done.wait(10)
            return comm.current_scope()

    def fn():
        mesh = init_device_mesh("cpu", (2,))
        if mesh.get_rank() == 0:
            with CommTrace(rank=0):
                assert inside.wait(10)
            trace_done.set()
            return None
        deadline = time.monotonic() + 10
        while _global_hook_counts() == before:         # wait for rank 0's trace to install its hooks
            assert time.monotonic() < deadline
            time.sleep(0.001)
        during = Slow()(None)
        return during, comm.current_scope()

    before = _global_hook_counts()
    during, after = run_spmd(fn, 2)[1]
    assert during == ("Slow",) and after == ()
    assert _global_hook_counts() == before


def test_modules_false_installs_no_hooks():
    before = _global_hook_counts()
    with CommTrace(modules=False):
        assert _global_hook_counts() == before


# -- outputs: summary, JSON, Chrome trace ----------------------------------------------------

def _traced_run():
    def fn():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = distribute_tensor(torch.ones(8, 8), mesh, [S0, S1])
        x.redistribute(mesh, [R, S1])
        Gather()(distribute_tensor(torch.ones(8), mesh["tp"], [S0]))

    with CommTrace() as trace:
        run_spmd(fn, 4)
    return trace


def test_summary_tables():
    trace = _traced_run()
    text = trace.summary()
    lines = text.splitlines()
    assert lines[0].startswith("CommTrace: ") and "on 4 ranks (0-3)" in lines[0]
    kind_head = next(i for i, l in enumerate(lines) if l.startswith("kind "))
    assert lines[kind_head].split() == ["kind", "count", "ranks", "sent", "received", "time"]
    kinds = {l.split()[0] for l in lines[kind_head + 2:] if l and not l.startswith("-")}
    assert {"broadcast", "all_gather", "total"} <= kinds
    assert any(l.startswith("module / op") for l in lines)
    assert "Gather / redistribute" in text and "(no scope)" in text
    ag = trace.group("kind")[("all_gather",)]
    # (S0,S1)->(R,S1): 4 ranks x 64 B; Gather on the tp sub-mesh, (8,) over 2: 4 ranks x 16 B
    assert ag["count"] == 8 and ag["bytes_sent"] == 4 * 64 + 4 * 16
    by_rank = trace.summary(by=[("rank", "kind")])
    assert "0 | all_gather" in by_rank and "3 | broadcast" in by_rank
    with pytest.raises(ValueError, match="unknown summary key"):
        trace.summary(by=["colour"])


def test_print_summary(capsys):
    trace = _traced_run()
    trace.print_summary()
    assert capsys.readouterr().out.strip() == trace.summary().strip()


def test_to_json(tmp_path):
    trace = _traced_run()
    path = trace.to_json(tmp_path / "trace.json")
    data = json.loads(pathlib.Path(path).read_text())
    assert len(data["events"]) == len(trace.events) > 0
    assert data["totals"]["bytes_sent"] == sum(e.bytes_sent for e in trace.events)
    assert data["by_kind"]["all_gather"]["count"] == 8
    ev = next(e for e in data["events"] if e["scope"] == ["Gather", "redistribute"])
    assert ev["kind"] == "all_gather" and ev["group_size"] == 2 and ev["bytes_sent"] == 16
    assert ev["dtype"] == "float32" and ev["module"] == "Gather" and ev["mesh_dim"] == 0
    assert set(ev) >= {"rank", "group", "bytes_received", "shape", "seconds", "start", "backend"}


def test_chrome_trace(tmp_path):
    trace = _traced_run()
    path = trace.chrome_trace(tmp_path / "chrome.json")
    data = json.loads(pathlib.Path(path).read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(trace.events)
    assert {e["tid"] for e in xs} == {0, 1, 2, 3} and {e["pid"] for e in xs} == {0}
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    for e in xs:
        assert e["ts"] >= 0 and e["dur"] >= 0
        assert {"bytes_sent", "bytes_received", "group", "group_size", "dtype", "scope"} <= set(e["args"])
    g = next(e for e in xs if e["args"]["scope"] == "Gather / redistribute")
    assert g["name"] == "all_gather (redistribute)" and g["args"]["bytes_sent"] == 16
    # events match the trace's, rank by rank
    for r in range(4):
        assert sorted(e["args"]["bytes_sent"] for e in xs if e["tid"] == r) == \
            sorted(e.bytes_sent for e in trace.events if e.rank == r)


# -- torch.distributed (4 gloo processes) ----------------------------------------------------

def _gloo_trace(rank: int, world_size: int):
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.ones(7, 16), mesh, [S0])
    p = DTensor.from_local(torch.ones(8, 16), mesh, [P])
    with CommTrace() as t:
        Gather()(x)
        p.redistribute(mesh, [S0])
    return [(e.kind, e.rank, e.scope, e.bytes_sent, e.bytes_received, e.group_size, e.backend) for e in t.events]


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
def test_trace_under_gloo():
    dist_helpers = pytest.importorskip("distributed")
    if not dist_helpers.gloo_available():
        pytest.skip("gloo is not available")
    out = dist_helpers.run_multiprocess(_gloo_trace, 4, timeout=90)
    for rank, evs in enumerate(out):
        assert [e[:3] for e in evs] == [("all_gather", rank, ("Gather", "redistribute")),
                                        ("reduce_scatter", rank, ("redistribute",))]
        assert evs[0][3:6] == (3 * 2 * _nbytes(16), 3 * 2 * _nbytes(16), 4)   # uneven 7 rows: c = 2
        assert evs[1][3:6] == (3 * _nbytes(8, 16) // 4, 3 * _nbytes(8, 16) // 4, 4)
        assert all(e[6] == "torch.distributed/gloo" for e in evs)


# -- visualize_sharding ----------------------------------------------------------------------

def _layouts():
    def fn():
        m1 = init_device_mesh("cpu", (4,))
        m = init_device_mesh("cpu", (2, 2))
        c = m.get_coordinate()
        partial = DTensor.from_local(torch.ones(4 if c[1] == 0 else 3, 3), m, [P, S0], shape=(7, 3))
        return {
            "1d": describe_sharding(distribute_tensor(torch.zeros(7), m1, [S0])),
            "s0s1": describe_sharding(distribute_tensor(torch.zeros(7, 5), m, [S0, S1])),
            "s0s0": describe_sharding(distribute_tensor(torch.zeros(7, 5), m, [S0, S0])),
            "partial": describe_sharding(partial),
            "replicate": describe_sharding(distribute_tensor(torch.zeros(7, 5), m1, [R])),
            "empty": describe_sharding(distribute_tensor(torch.zeros(3, 5), m1, [S0])),
            "3d": describe_sharding(distribute_tensor(torch.zeros(2, 6, 5), m, [S0, S0])),
        }

    out = run_spmd(fn, 4)
    assert all(o == out[0] for o in out)  # every rank draws the same picture, without communication
    return out[0]


EXPECTED = {
    "1d": """\
DTensor (7,) float32 on mesh (4,): (S(0))
      0:2            2:4            4:6         6:7
+--------------+--------------+--------------+-------+
|      r0      |      r1      |      r2      |   r3  |
+--------------+--------------+--------------+-------+""",
    "s0s1": """\
DTensor (7, 5) float32 on mesh (2, 2): (S(0), S(1))
                  0:3                      3:5
    +-----------------------------+-------------------+
    |                             |                   |
0:4 |              r0             |         r1        |
    |                             |                   |
    |                             |                   |
    +-----------------------------+-------------------+
    |                             |                   |
4:7 |              r2             |         r3        |
    |                             |                   |
    +-----------------------------+-------------------+""",
    "s0s0": """\
DTensor (7, 5) float32 on mesh (2, 2): (S(0)[0], S(0)[1])
                           0:5
    +------------------------------------------------+
0:2 |                       r0                       |
    |                                                |
    +------------------------------------------------+
2:4 |                       r1                       |
    |                                                |
    +------------------------------------------------+
4:6 |                       r2                       |
    |                                                |
    +------------------------------------------------+
6:7 |                       r3                       |
    +------------------------------------------------+""",
    "partial": """\
DTensor (7, 3) float32 on mesh (2, 2): (P(sum), S(0))
                           0:3
    +------------------------------------------------+
    |                                                |
0:4 |                    P r0,r2                     |
    |                                                |
    |                                                |
    +------------------------------------------------+
    |                                                |
4:7 |                    P r1,r3                     |
    |                                                |
    +------------------------------------------------+
P(sum) over mesh dim 0: ranks hold terms; value = sum over mesh dim 0""",
    "replicate": """\
DTensor (7, 5) float32 on mesh (4,): (R)
                           0:5
    +------------------------------------------------+
    |                                                |
    |                                                |
    |                                                |
0:7 |                     r0-r3                      |
    |                                                |
    |                                                |
    |                                                |
    +------------------------------------------------+""",
    "empty": """\
DTensor (3, 5) float32 on mesh (4,): (S(0))
                           0:5
    +------------------------------------------------+
0:1 |                       r0                       |
    +------------------------------------------------+
1:2 |                       r1                       |
    +------------------------------------------------+
2:3 |                       r2                       |
    +------------------------------------------------+
empty pieces: r3 (0, 5)""",
    "3d": """\
DTensor (2, 6, 5) float32 on mesh (2, 2): (S(0)[0], S(0)[1])
  dim 0 (2): split by mesh dim 0 x2 then mesh dim 1 x2: pieces 1,0,1,0
  dim 1 (6): not split
  dim 2 (5): not split
empty pieces: r1,r3 (0, 6, 5)""",
}


def test_visualize_exact_layouts():
    got = _layouts()
    for name, want in EXPECTED.items():
        assert got[name] == want, f"{name}:\n{got[name]}"


def test_visualize_shard_order_and_names():
    def fn():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = distribute_tensor(torch.zeros(5, 5), mesh, [S0, S0])
        y = x.redistribute(mesh, [S0, S0], shard_order={0: [1, 0]})
        return describe_sharding(y), describe_sharding(distribute_tensor(torch.zeros(4, 4, 4), mesh, [R, S1]))

    nested, three = run_spmd(fn, 4)[0]
    lines = nested.splitlines()
    assert lines[0] == "DTensor (5, 5) float32 on mesh (2, 2) [dp, tp]: (S(0)[1], S(0)[0])"
    # mesh dim 1 splits first: rows 2:3 belong to coordinate (1, 0) = rank 2
    assert [l.split()[0] + " " + l.split()[2] for l in lines if l[:1].isdigit()] == \
        ["0:2 r0", "2:3 r2", "3:4 r1", "4:5 r3"]
    assert three.splitlines()[1:] == ["  dim 0 (4): not split", "  dim 1 (4): split by mesh dim 1 (tp) x2: pieces 2,2",
                                      "  dim 2 (4): not split", "R over mesh dim 0 (dp): ranks hold copies"]


def test_visualize_prints_once_per_mesh_and_returns_everywhere(capsys):
    def fn():
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(torch.zeros(7, 5), mesh, [S0, S1])
        a = visualize_sharding(x, use_rich=False, header="weights")
        b = visualize_sharding(distribute_tensor(torch.zeros(4), mesh[1], [S0]), use_rich=False)
        return a, b

    out = run_spmd(fn, 4)
    printed = capsys.readouterr().out
    assert printed.count("weights\nDTensor (7, 5)") == 1                # once for the 2-D mesh
    assert printed.count("DTensor (4,) float32 on mesh (2,)") == 2     # once per 1-D sub-mesh (2 of them)
    assert all(o[0] == out[0][0] for o in out) and out[0][0].startswith("weights\n" + EXPECTED["s0s1"].splitlines()[0])
    assert "r0" in out[0][1] and "r2" in out[2][1]                      # each sub-mesh names its own ranks


def test_visualize_rich_matches_ascii(capsys):
    def fn():
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(torch.zeros(7, 5), mesh, [S0, S1])
        return visualize_sharding(x, use_rich=True), describe_sharding(x)

    coloured, plain = run_spmd(fn, 4)[0]
    capsys.readouterr()
    assert "\x1b[" in coloured
    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured) == plain


def test_visualize_png(tmp_path):
    import matplotlib.image

    def fn():
        m1 = init_device_mesh("cpu", (4,))
        m = init_device_mesh("cpu", (2, 2))
        c = m.get_coordinate()
        visualize_sharding(distribute_tensor(torch.zeros(7), m1, [S0]), png=str(tmp_path / "a.png"))
        visualize_sharding(distribute_tensor(torch.zeros(7, 5), m, [S0, S1]), png=str(tmp_path / "b.png"))
        partial = DTensor.from_local(torch.ones(4 if c[1] == 0 else 3, 3), m, [P, S0], shape=(7, 3))
        visualize_sharding(partial, png=str(tmp_path / "c.png"))
        visualize_sharding(distribute_tensor(torch.zeros(2, 6, 5), m, [S0, S0]), png=str(tmp_path / "d.png"))

    run_spmd(fn, 4)
    for name in "abcd":
        path = tmp_path / f"{name}.png"
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 0
        img = matplotlib.image.imread(path)
        assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 50


def test_visualize_rejects_plain_tensors():
    with pytest.raises(TypeError, match="needs a DTensor"):
        visualize_sharding(torch.zeros(3))


# -- DispatchProfile and cache_stats ------------------------------------------------------------

def _profiled_step():
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.randn(8, 6), mesh, [S0])
    w = distribute_tensor(torch.randn(6, 6), mesh, [R])
    for _ in range(3):
        y = (x @ w).sum(0)  # Partial(sum): nothing moves yet
    return y.redistribute(mesh, [R]).to_local()


def test_dispatch_profile_counts_calls_misses_and_plans():
    from shardtensor.propagation import clear_cache
    from shardtensor.redistribute import planner
    clear_cache()
    planner.clear_cache()
    with DispatchProfile() as prof:
        outs = run_spmd(_profiled_step, 2)
    d = prof.to_dict()["ops"]
    assert d["aten.mm.default"]["calls"] == 6 and d["aten.sum.dim_IntList"]["calls"] == 6  # 3 per rank
    assert 1 <= d["aten.mm.default"]["decided"] <= 2  # the ranks share the cache; both may miss at once
    assert d["redistribute"]["planned"] >= 1 and d["redistribute"]["calls"] == 0
    for row in d.values():
        assert row["own"] <= row["total"] + 1e-9 and row["decide_s"] >= 0
    text = prof.summary()
    assert "aten.mm.default" in text and "decisions cache:" in text and "plans cache:" in text
    torch.testing.assert_close(outs[0], outs[1])
    # closed, the dispatch entry is the plain one again, and a second profile may open
    assert "timed" not in DTensor.__dict__["__torch_dispatch__"].__func__.__qualname__
    with DispatchProfile():
        with pytest.raises(RuntimeError, match="already open"):
            DispatchProfile().__enter__()


def test_cache_stats_hits_after_the_first_call():
    from shardtensor.propagation import clear_cache

    def body():
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(torch.randn(4, 4), mesh, [S0])
        for _ in range(5):
            x = x * 2.0
        return x.to_local()
    clear_cache()
    before = cache_stats()
    run_spmd(body, 2)
    after = cache_stats()
    assert set(after) == {"decisions", "plans"}
    assert after["decisions"]["misses"] - before["decisions"]["misses"] <= 2
    assert after["decisions"]["hits"] - before["decisions"]["hits"] >= 8


# -- every python example of docs/ runs --------------------------------------------------------

DOC_BLOCKS = [(p.name, i, b) for p in sorted((ROOT / "docs").glob("*.md"))
              for i, b in enumerate(re.findall(r"```python\n(.*?)```", p.read_text(), re.S))]


def test_docs_have_examples():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"placements.md", "meshes.md", "propagation.md", "redistribution.md", "debugging.md"} <= names
    assert len(DOC_BLOCKS) >= 5


@pytest.mark.parametrize("name,i,block", DOC_BLOCKS, ids=[f"{n}-{i}" for n, i, _ in DOC_BLOCKS])
def test_docs_block_runs(name, i, block, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    exec(compile(block, f"docs/{name} block {i}", "exec"), {"__name__": "__docs__"})
    assert capsys.readouterr().out.strip()


def _world_body(n_ops):
    from shardtensor import Replicate, Shard, comm, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    with comm.recording() as log, CommTrace(modules=False) as trace:
        for _ in range(n_ops):
            x.redistribute(mesh, [Replicate()])
    return {e.world for e in log.events}, len(log.of_rank(mesh.get_rank())), len(trace.of_rank(mesh.get_rank()))


def _in_threads(fn, ns) -> dict:
    """``{n: fn(n)}``, each call on a thread of its own, all started together (as a thread pool or
    pytest-xdist would run them); fails if one never finishes."""
    import threading

    results = {}
    start = threading.Barrier(len(ns))

    def worker(n):
        start.wait(timeout=60)
        results[n] = fn(n)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a simulated world never finished"
    return results


def test_recording_is_scoped_to_its_world():
    """Two simulated worlds running at once, started from two threads: a log opened inside a rank
    sees only its own world; one opened in the main thread sees neither (their worlds belong to
    the threads that started them) unless it asks for every thread, each event tagged with its
    world."""
    from shardtensor import comm, run_spmd

    with comm.recording() as outside, comm.recording(all_threads=True) as everywhere:
        results = _in_threads(lambda n: run_spmd(_world_body, 4, n), (1, 3))
    for n in (1, 3):
        for worlds, n_log, n_trace in results[n]:
            assert len(worlds) == 1 and n_log == n and n_trace == n, (n, worlds, n_log, n_trace)
    seen = {next(iter(results[n][0][0])) for n in (1, 3)}
    assert len(seen) == 2 and {e.world for e in everywhere.events} == seen
    assert outside.events == []


def test_recordings_opened_in_two_threads_keep_their_own_worlds():
    """As a thread pool or pytest-xdist would: each thread records while it runs its own world."""
    from shardtensor import comm, run_spmd

    def body(n):
        with comm.recording() as log, CommTrace(modules=False) as trace:
            run_spmd(_world_body, 4, n)
        return ({e.world for e in log.events}, sum(e.kind == "all_gather" for e in log.events),
                sum(e.kind == "all_gather" for e in trace.events))

    results = _in_threads(body, (2, 5))
    for n in (2, 5):
        worlds, n_log, n_trace = results[n]
        assert len(worlds) == 1 and n_log == 4 * n and n_trace == 4 * n, (n, results[n])
    assert results[2][0] != results[5][0]


def test_comm_debug_mode_counts_this_ranks_collectives_by_torchs_ops():
    """torch's counter API: the calling rank's collectives keyed by torch's functional collectives."""
    import torch.distributed.tensor  # noqa: F401  (registers torch.ops.c10d_functional, as torch users have it)

    from shardtensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh, run_spmd
    from shardtensor.debug import CommDebugMode

    funcol = torch.ops.c10d_functional

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0), Shard(1)])
        with CommDebugMode() as mode:
            x.redistribute(mesh, [Replicate(), Replicate()])
            y = distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Shard(0)])
            (y.redistribute(mesh, [Replicate(), Shard(1)]) @ y).full_tensor()
        line = init_device_mesh("cpu", (4,))
        z = distribute_tensor(torch.ones(8), line, [Shard(0)])
        with CommDebugMode() as gather:
            z.redistribute(line, [Replicate()])
        return mode.get_comm_counts(), mode.get_total_counts(), len(mode.trace.events), gather.get_comm_counts()

    for counts, total, events, gather in run_spmd(body, 4):
        assert total == sum(counts.values()) == events and total >= 3
        assert set(counts) <= {funcol.all_gather_into_tensor, funcol.all_to_all_single, funcol.all_reduce,
                               funcol.reduce_scatter_tensor, funcol.broadcast}
        assert gather == {funcol.all_gather_into_tensor: 1}
