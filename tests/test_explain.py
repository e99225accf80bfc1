"""``explain_redistribute`` and ``shardtensor plan``: steps, bytes, lower bound, JSON, PNG, errors."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from shardtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh, run_spmd
from shardtensor.cli import main
from shardtensor.debug import CommTrace
from shardtensor.redistribute.cost import LinkModel
from shardtensor.redistribute.exchange import exchange_dims
from shardtensor.redistribute.explain import (Explanation, explain_redistribute, format_bytes, parse_dtype,
                                              parse_placements, parse_shard_order, parse_spec)
from shardtensor.redistribute.planner import plan

pytestmark = pytest.mark.main_release  # our own algorithms: the main torch release runs them (tests/conftest.py)

KiB = 1024
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def cli(capsys, *args: str) -> str:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def cli_json(capsys, *args: str) -> dict:
    return json.loads(cli(capsys, *args, "--json"))


def steps_of(d: dict) -> list[tuple]:
    return [(s["mesh_dim"], s["collective"], s["bytes_per_rank"], s["group_size"]) for s in d["steps"]]


# -- fixed cases through the CLI ---------------------------------------------------------------

def test_cli_one_dim_all_gather_table(capsys):
    out = cli(capsys, "--mesh", "4", "--shape", "8,1024", "--src", "S0", "--dst", "R")
    lines = out.splitlines()
    assert lines[0] == "redistribute (8, 1024) float32 on mesh (4,): (S(0)) -> (R)"
    assert lines[1].split() == ["#", "mesh", "dim", "k", "transition", "collective", "logical", "shape", "bytes/rank",
                                "time"]
    assert lines[2].split()[:8] == ["1", "0", "4", "(S(0))", "->", "(R)", "all_gather", "(8,"]
    assert "24 KiB" in lines[2]
    assert len([ln for ln in lines if ln[:1].isdigit()]) == 1  # one step
    assert lines[3].startswith("total: 24 KiB per rank (24576 bytes)")
    assert lines[4].startswith("lower bound: 24 KiB per rank (24576 bytes)") and "meets it" in lines[4]
    assert "mesh dim 0: S(0) -> R (k=4) needs an all-gather" in out


@pytest.mark.parametrize("src,dst,kind,kib", [
    ("S0", "R", "all_gather", 24),        # X = (8, 1024) fp32 = 32 KiB, k = 4
    ("P", "S0", "reduce_scatter", 24),
    ("P", "R", "all_reduce", 48),
    ("S0", "S1", "all_to_all", 6),
    ("R", "S1", "chunk", 0),
    ("R", "P(max)", "partition", 0),
    ("P(sum)", "P(avg)", "rescale", 0),
])
def test_cli_examples(capsys, src, dst, kind, kib):
    for dtype, scale in (("float32", 1), ("bf16", 2)):
        d = cli_json(capsys, "--mesh", "4", "--shape", "8,1024", "--src", src, "--dst", dst, "--dtype", dtype)
        assert steps_of(d) == [(0, kind, kib * KiB // scale, 4)]
        assert d["total_bytes_per_rank"] == kib * KiB // scale
        assert d["itemsize"] == 4 // scale
        # on a 1-D mesh every single collective meets the bound
        assert d["lower_bound"]["bytes_per_rank"] == d["total_bytes_per_rank"]


def test_cli_uneven_all_gather_sends_padding(capsys):
    # 7 rows of 1 KiB over 4 ranks, c = 2: an all-gather sends 3 * 2 = 6 KiB, not 5.25
    d = cli_json(capsys, "--mesh", "4", "--shape", "7,256", "--src", "S0", "--dst", "R")
    assert steps_of(d) == [(0, "all_gather", 6 * KiB, 4)]
    assert d["lower_bound"]["bytes_per_rank"] == 5.25 * KiB


def test_cli_partial_to_nested_shards_two_reduce_scatters(capsys):
    d = cli_json(capsys, "--mesh", "2,2", "--shape", "8,1024", "--src", "P,P", "--dst", "S0,S0")
    assert steps_of(d) == [(0, "reduce_scatter", 16 * KiB, 2), (1, "reduce_scatter", 8 * KiB, 2)]
    assert [(s["before"], s["after"]) for s in d["steps"]] == [
        ("(P(sum), P(sum))", "(S(0), P(sum))"), ("(S(0), P(sum))", "(S(0)[0], S(0)[1])")]
    assert [s["logical_shape"] for s in d["steps"]] == [[8, 1024], [4, 1024]]
    assert d["total_bytes_per_rank"] == 24 * KiB
    assert d["lower_bound"]["bytes_per_rank"] == 16 * KiB
    bf = cli_json(capsys, "--mesh", "2,2", "--shape", "8,1024", "--src", "P,P", "--dst", "S0,S0", "--dtype", "bf16")
    assert [b for *_, b, _ in steps_of(bf)] == [8 * KiB, 4 * KiB] and bf["total_bytes_per_rank"] == 12 * KiB
    out = cli(capsys, "--mesh", "2,2", "--shape", "8,1024", "--src", "P,P", "--dst", "S0,S0")
    assert out.count("reduce_scatter") == 2 and "total: 24 KiB per rank (24576 bytes)" in out


def test_cli_reduces_the_half_tensor_first(capsys):
    # (P, S0) -> (R, R): all-reduce the half tensor first, then gather (gathering first would
    # all-reduce the whole tensor: 48 KiB instead of 32)
    args = ["--mesh", "2,2", "--shape", "8,1024", "--src", "P,S0", "--dst", "R,R"]
    opt = cli_json(capsys, *args)
    assert steps_of(opt) == [(0, "all_reduce", 16 * KiB, 2), (1, "all_gather", 16 * KiB, 2)]
    assert opt["lower_bound"]["bytes_per_rank"] == 24 * KiB


def test_cli_two_d_example(capsys):
    # default links: one all-to-all over the flattened (2,2) group, the same 96 bytes as the two
    # per-dim steps below, one launch instead of two
    out = cli(capsys, "--mesh", "2,2", "--shape", "8,6", "--src", "S0,S1", "--dst", "R,S0")
    assert "(S(0), S(1)) -> (R, S(0))" in out and " 0+1 " in out
    d = cli_json(capsys, "--mesh", "2,2", "--shape", "8,6", "--src", "S0,S1", "--dst", "R,S0")
    assert steps_of(d) == [(0, "all_to_all", 96, 4)] and d["steps"][0]["mesh_dims"] == [0, 1]
    assert d["total_bytes_per_rank"] == 96 and d["lower_bound"]["bytes_per_rank"] == 72
    # with free launches the ring hops decide: all-gather on mesh dim 0, then all-to-all on mesh dim 1
    ex = explain_redistribute((2, 2), (8, 6), "S0,S1", "R,S0", links=LinkModel(launch=0.0))
    assert [(s.mesh_dim, s.collective, s.bytes, s.group_size) for s in ex.steps] == [
        (0, "all_gather", 48, 2), (1, "all_to_all", 48, 2)]
    assert "(S(0), S(1)) -> (R, S(1))" in ex.to_text() and "(R, S(1)) -> (R, S(0))" in ex.to_text()


def test_order_only_change_has_bound_zero(capsys):
    a = cli_json(capsys, "--mesh", "2,2", "--shape", "8,8", "--src", "S0,S0", "--dst", "S0,S0", "--dst-order", "0:1,0")
    b = cli_json(capsys, "--mesh", "2,2", "--shape", "8,8", "--src", "S0,S0", "--dst", "S(0)[1],S(0)[0]")
    assert a == b
    assert a["dst"]["display"] == "(S(0)[1], S(0)[0])" and a["dst"]["order"] == [[0, [1, 0]]]
    assert a["lower_bound"]["bytes_per_rank"] == 0 and a["total_bytes_per_rank"] > 0
    assert a["steps"][-1]["after"] == "(S(0)[1], S(0)[0])"
    same = cli_json(capsys, "--mesh", "2,2", "--shape", "8,8", "--src", "S0,S0", "--src-order", "0:1,0",
                    "--dst", "S(0)[1],S(0)[0]")
    assert same["steps"] == [] and same["total_bytes_per_rank"] == 0


def test_steps_are_the_planners_and_states_chain():
    ex = explain_redistribute((2, 2, 2), (8, 6, 4), "S0,S1,P", "S1,S0,S0", src_order="1:1")
    src = (Shard(0), Shard(1), Partial())
    dst = (Shard(1), Shard(0), Shard(0))
    assert ex.plan_steps == plan(src, ((0, (0,)), (1, (1,))), dst, ((0, (1, 2)), (1, (0,))), (8, 6, 4), (2, 2, 2), 4)
    for e in (ex,):
        state = (e.src_placements, e.src_order)
        for s in e.steps:
            assert (s.placements_before, s.order_before) == state
            state = (s.placements_after, s.order_after)
        assert state == (e.dst_placements, e.dst_order)
        assert e.total_bytes == sum(s.bytes for s in e.steps)


def test_bytes_match_comm_trace_of_real_run():
    """What the simulated world records on rank 0 (coordinate 0, the largest pieces) = the model."""
    cases = [((8, 1024), [Partial(), Shard(0)], [Replicate(), Replicate()]),
             ((7, 5), [Shard(0), Shard(1)], [Shard(1), Shard(0)]),
             ((9, 6), [Partial(), Partial()], [Shard(0), Shard(0)])]

    def fn():
        mesh = init_device_mesh("cpu", (2, 2))
        out = []
        for shape, a, b in cases:
            local = distribute_tensor(torch.randn(shape), mesh, [Replicate() if p.is_partial() else p for p in a])
            x = DTensor.from_local(local.to_local(), mesh, a, shape=shape)  # terms of a Partial value
            with CommTrace(rank=mesh.get_rank()) as t:
                x.redistribute(mesh, b)
            out.append([(e.kind, e.mesh_dim, e.group_size, max(e.bytes_sent, e.bytes_received)) for e in t.events])
        return out

    # the model prices a step by its busiest rank: coordinate 0 for ring collectives (the largest,
    # padded pieces), the busiest rank of the exchange for a direct all-to-all
    traced = run_spmd(fn, 4)
    for i, (shape, a, b) in enumerate(cases):
        ex = explain_redistribute((2, 2), shape, a, b)
        want = [(s.collective, s.dims_label if s.mesh_dims else s.mesh_dim, s.group_size, s.bytes)
                for s in ex.steps if s.bytes]
        per_rank = [r[i] for r in traced]
        got = [(k, "+".join(map(str, md)) if isinstance(md, tuple) else md, g, max(ev[j][3] for ev in per_rank))
               for j, (k, md, g, _) in enumerate(per_rank[0])]
        assert got == want, (shape, a, b)


# -- lower bound ---------------------------------------------------------------------------------

KINDS = [Replicate(), Partial("sum"), Partial("avg"), Partial("max")]


def _random_spec(rng: random.Random, m: int, n: int):
    pl = [rng.choice(KINDS + [Shard(d) for d in range(n)] * 2) for _ in range(m)]
    lists: dict[int, list[int]] = {}
    for j, p in enumerate(pl):
        if isinstance(p, Shard):
            lists.setdefault(p.dim, []).append(j)
    return pl, {d: tuple(rng.sample(js, len(js))) for d, js in lists.items()}


def test_lower_bound_never_exceeds_plan_random_pairs():
    rng = random.Random(1234)
    tight = 0
    for _ in range(800):
        m, n = rng.randint(1, 3), rng.randint(0, 3)
        mesh = tuple(rng.choice([1, 2, 2, 3, 4]) for _ in range(m))
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 8, 12, 16]) for _ in range(n))
        (a, ao), (b, bo) = _random_spec(rng, m, n), _random_spec(rng, m, n)
        links = None if rng.random() < 0.7 else [LinkModel(rng.choice([1e-6, 5e-6]), rng.choice([1e-11, 1e-10]))
                                                 for _ in range(m)]
        ex = explain_redistribute(mesh, shape, a, b, dtype=rng.choice(["fp32", "bf16", "float64"]), src_order=ao,
                                  dst_order=bo, links=links)
        assert ex.lower_bound_bytes <= ex.total_bytes, (mesh, shape, a, ao, b, bo)
        assert ex.lower_bound_time <= ex.total_time * (1 + 1e-9), (mesh, shape, a, ao, b, bo)
        terms = sum(t.bytes for t in ex.bound_terms)
        if exchange_dims(ex.src_placements, ex.src_order, ex.dst_placements, ex.dst_order, mesh) is None:
            assert ex.lower_bound_bytes == pytest.approx(terms, rel=1e-12)
        else:  # capped by what the busiest rank misses of its target block
            assert ex.lower_bound_bytes <= terms * (1 + 1e-12)
        tight += ex.total_bytes > 0 and ex.lower_bound_bytes == ex.total_bytes
    assert tight > 20  # the bound is met often (single collectives on a fully split tensor)


def test_lower_bound_terms_explain_each_mesh_dim():
    ex = explain_redistribute((2, 4), (8, 1024), "S0,P", "S1,R")
    t0, t1 = ex.bound_terms
    assert (t0.collective, t0.bytes) == ("all_to_all", 32 * KiB / 4 / 4)      # (k-1)/k^2 of |X|/4, k = 2
    assert (t1.collective, t1.bytes) == ("all_reduce", 32 * KiB / 2 * 2 * 3 / 4)  # 2(k-1)/k of |X|/2, k = 4
    assert "all-to-all" in t0.reason and "reduce-scatter and later an all-gather" in t1.reason
    assert ex.lower_bound_bytes == t0.bytes + t1.bytes <= ex.total_bytes


# -- JSON ----------------------------------------------------------------------------------------

def test_json_round_trip(capsys):
    ex = explain_redistribute((2, 3), (7, 5, 2), "S(0)[1],S(0)[0]", "P(max),S2", dtype=torch.bfloat16,
                              links=[LinkModel(1e-6, 1e-11), LinkModel(2e-6, 3e-11)])
    d = ex.to_dict()
    text = json.dumps(d)
    assert json.loads(text) == d
    assert Explanation.from_dict(json.loads(text)) == ex
    assert d["dtype"] == "bfloat16" and d["src"]["order"] == [[0, [1, 0]]] and d["links"][1]["beta"] == 3e-11
    assert any("refused" in n for n in d["notes"])  # S -> P is backward-only in the executor
    got = cli_json(capsys, "--mesh", "2,3", "--shape", "7,5,2", "--src", "S0,S0", "--src-order", "0:1,0",
                   "--dst", "P(max),S2", "--dtype", "bf16")
    plain = explain_redistribute((2, 3), (7, 5, 2), "S(0)[1],S(0)[0]", "P(max),S2", dtype="bf16").to_dict()
    assert got == json.loads(json.dumps(plain))


# -- PNG -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh,shape,src,dst", [
    ((2, 2), (8, 6), "S0,S1", "R,S0"),
    ((4,), (7,), "S0", "R"),
    ((2, 2), (5, 8), "P,P", "S0,S0"),
    ((2, 2), (8, 8, 4), "S0,P(max)", "S1,P"),
    ((2, 2), (8, 8), "R,R", "R,R"),
    ((2,), (), "P", "R"),
    ((2, 2), (0, 4), "S0,S1", "S1,S0"),
])
def test_draw_writes_valid_png(tmp_path, mesh, shape, src, dst):
    from matplotlib.image import imread

    path = tmp_path / "plan.png"
    ex = explain_redistribute(mesh, shape, src, dst)
    assert ex.draw(str(path)) == str(path)
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 500
    assert img[..., :3].std() > 0.01  # something is drawn


def test_cli_png(tmp_path, capsys):
    path = tmp_path / "p.png"
    out = cli(capsys, "--mesh", "2,2", "--shape", "8,6", "--src", "S0,S1", "--dst", "R,S0", "--png", str(path))
    assert f"wrote {path}" in out
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    # with --json the stdout stays pure JSON
    assert main(["plan", "--mesh", "2", "--shape", "4", "--src", "S0", "--dst", "R", "--json", "--png", str(path)]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["steps"][0]["collective"] == "all_gather" and "wrote" in cap.err


# -- parsing and errors --------------------------------------------------------------------------

def test_parse_placements_forms():
    assert parse_placements("S0,S1", 2) == (Shard(0), Shard(1))
    assert parse_placements("R, S0", 2) == (Replicate(), Shard(0))
    assert parse_placements("P,P", 2) == (Partial("sum"), Partial("sum"))
    assert parse_placements("P(max),S1", 2) == (Partial("max"), Shard(1))
    assert parse_placements("(Shard(dim=2), Replicate(), Partial(avg))", 3) == (Shard(2), Replicate(), Partial("avg"))
    assert parse_placements("s(-1)", 1) == (Shard(-1),)
    assert parse_spec("S(0)[1],S(0)[0]", 2) == ((Shard(0), Shard(0)), {0: (1, 0)})
    assert parse_shard_order("0:1,0; 1:2") == {0: (1, 0), 1: (2,)}
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.int8") is torch.int8
    assert format_bytes(24576) == "24 KiB" and format_bytes(1536) == "1.5 KiB" and format_bytes(96) == "96 B"


@pytest.mark.parametrize("text,n,match", [
    ("S0,S1", 1, "got 2 placements"),
    ("S0", 2, "got 1 placements"),
    ("Q,R", 2, "cannot parse placement 'Q'"),
    ("P(foo)", 1, "cannot parse placement"),
    ("S(0", 1, "unbalanced"),
    ("", 1, "empty placements"),
    ("S0,,R", 3, "cannot parse placement ''"),
    ("S(0)[0],S(0)[0]", 2, "positions"),
])
def test_parse_placements_errors(text, n, match):
    with pytest.raises(ValueError, match=match):
        parse_placements(text, n)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(src="S2,R"), ValueError, "source: .*out of range"),
    (dict(dst="R,S0", dst_order="0:0"), ValueError, "target: shard order"),
    (dict(src_order="0-1"), ValueError, "cannot parse shard order"),
    (dict(dtype="fp7"), ValueError, "unknown dtype"),
    (dict(mesh_shape=(2, 0)), ValueError, "size 0"),
    (dict(mesh_shape=()), ValueError, "at least one dim"),
    (dict(shape=(8, -1)), ValueError, "size -1"),
    (dict(links=[LinkModel()]), ValueError, "one LinkModel per mesh dim"),
    (dict(src=Shard(0)), TypeError, "sequence of Placement"),
    (dict(dst="S(0)[1],S(0)[0]", dst_order="0:0,1"), ValueError, "contradicts"),
])
def test_explain_errors(kwargs, exc, match):
    args = dict(mesh_shape=(2, 2), shape=(8, 6), src="S0,R", dst="R,R")
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        explain_redistribute(**args)


@pytest.mark.parametrize("args,match", [
    (["--mesh", "2,x", "--shape", "8,6", "--src", "S0,R", "--dst", "R,R"], "mesh shape must be comma-separated"),
    (["--mesh", "2,2", "--shape", "8,6", "--src", "S0", "--dst", "R,R"], "got 1 placements"),
    (["--mesh", "2,2", "--shape", "8,6", "--src", "S0,S5", "--dst", "R,R"], "out of range"),
    (["--mesh", "2,2", "--shape", "8,6", "--src", "S0,R", "--dst", "R,R", "--dtype", "nope"], "unknown dtype"),
    (["--mesh", "2,2", "--shape", "8,6", "--src", "S0,R"], "required"),
    (["--mesh", "2,2", "--shape", "8,6", "--src", "S0,S0", "--dst", "R,R", "--src-order", "1:0,1"], "shard order"),
])
def test_cli_bad_arguments_exit_2(capsys, args, match):
    with pytest.raises(SystemExit) as e:
        main(["plan", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "shardtensor plan: error:" in err and match in err


def test_cli_png_unwritable_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--mesh", "2", "--shape", "4", "--src", "S0", "--dst", "R", "--png",
              str(tmp_path / "missing" / "p.png")])
    assert e.value.code == 2 and "cannot write" in capsys.readouterr().err


# -- the installed entry point ---------------------------------------------------------------------

def test_python_m_shardtensor_plan():
    out = subprocess.run([sys.executable, "-m", "shardtensor", "plan", "--mesh", "4", "--shape", "8,1024", "--src",
                          "S0", "--dst", "R", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert steps_of(d) == [(0, "all_gather", 24 * KiB, 4)] and d["total_bytes_per_rank"] == 24 * KiB
