"""shardtensor in real processes: 4 gloo ranks on localhost (torch.distributed transport).

Spawning processes is the expensive part, so every check that should pass runs in a single
spawned run (the ``gloo_report`` fixture): each rank runs every case, catches its own failures
and returns them, and each test below asserts on its section of that report.  A case that
fails the same way on every rank keeps the ranks in step, so later cases still run.  The
failure-handling tests (a rank that dies or raises) need runs of their own.

Oracle: the dense tensor, built from a fixed seed identically on every process (integer
values stored as float32, so sums, averages over 4 and maxima are exact); a rank's expected
local piece is cut from it with ``torch.chunk`` mesh dim by mesh dim in shard order.
"""
from __future__ import annotations

import os
import time
import traceback

import pytest

try:
    from distributed import MultiprocessError, gloo_available, run_multiprocess, run_multiprocess_outcomes
except ImportError:  # tests/ imported as a package
    from tests.distributed import MultiprocessError, gloo_available, run_multiprocess, run_multiprocess_outcomes

pytestmark = pytest.mark.skipif(not gloo_available(), reason="torch.distributed with gloo is not available")

WORLD = 4
SHAPES = [(8, 4), (7, 5), (13, 3)]


# ---------------------------------------------------------------------------------------
# helpers used inside the spawned ranks (top-level, importable)
# ---------------------------------------------------------------------------------------

def _dense(shape, seed, lead=()):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, (*lead, *shape), generator=g).to(torch.float32)


def _expected_local(full, mesh_shape, coord, placements, order=None):
    """The piece of ``full`` a rank at ``coord`` holds: torch.chunk per sharding mesh dim, in order."""
    import torch
    from shardtensor import Partial, Shard

    assert not any(isinstance(p, Partial) for p in placements), placements
    if order is None:
        seq = [j for j, p in enumerate(placements) if isinstance(p, Shard)]
    else:
        seq = [j for d in sorted(order) for j in order[d]]
    piece = full
    for j in seq:
        d = placements[j].dim
        parts = torch.chunk(piece, mesh_shape[j], dim=d)
        if coord[j] < len(parts):
            piece = parts[coord[j]]
        else:
            piece = piece.narrow(d, 0, 0)
    return piece


def _check_dtensor(t, full, placements, order=None, what=""):
    """``t`` has ``placements``, its local piece is the expected slice, its full_tensor is ``full``.

    The collective (full_tensor) runs before any assertion, so a rank whose check fails
    does not leave the others waiting in a collective it skipped.
    """
    import torch

    ft = t.full_tensor()
    mesh = t.device_mesh
    assert tuple(t.placements) == tuple(placements), f"{what}: placements {t.placements} != {tuple(placements)}"
    assert tuple(t.shape) == tuple(full.shape), f"{what}: global shape {tuple(t.shape)} != {tuple(full.shape)}"
    if order is not None:
        want_order = tuple((d, tuple(js)) for d, js in sorted(order.items()))
        assert t.shard_order == want_order, f"{what}: shard order {t.shard_order} != {want_order}"
    local = t.to_local()
    want = _expected_local(full, mesh.shape, mesh.get_coordinate(), placements, order)
    assert tuple(local.shape) == tuple(want.shape), (
        f"{what}: rank {mesh.get_rank()} coord {mesh.get_coordinate()} local shape {tuple(local.shape)}, "
        f"expected {tuple(want.shape)}")
    assert torch.equal(local, want), (
        f"{what}: rank {mesh.get_rank()} coord {mesh.get_coordinate()} local values differ from the expected slice\n"
        f"got {local}\nexpected {want}")
    assert torch.equal(ft, full), f"{what}: full_tensor differs from the dense value\ngot {ft}\nexpected {full}"


def _partial_source(mesh, shape, op, seed, n_partial_dims):
    """DTensor with Partial(op) on every mesh dim from per-rank terms; returns (dtensor, dense)."""
    import torch
    from shardtensor import DTensor, Partial

    terms = _dense(shape, seed, lead=(WORLD,))  # term of global rank r = terms[r]
    rank = mesh.get_rank()
    x = DTensor.from_local(terms[rank].clone(), mesh, [Partial(op)] * n_partial_dims)
    if op == "sum":
        dense = terms.sum(0)
    elif op == "avg":
        dense = terms.sum(0) / WORLD
    elif op == "max":
        dense = terms.amax(0)
    elif op == "min":
        dense = terms.amin(0)
    else:
        raise ValueError(op)
    return x, dense


class _Report:
    """Per-section list of (case, traceback) failures and count of cases run on this rank."""

    def __init__(self, rank):
        self.rank = rank
        self.failures: dict[str, list[tuple[str, str]]] = {}
        self.counts: dict[str, int] = {}

    def run(self, section, case, fn, *args):
        self.counts[section] = self.counts.get(section, 0) + 1
        self.failures.setdefault(section, [])
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - report every failure of every case
            self.failures[section].append((case, traceback.format_exc()))

    def result(self):
        return {"rank": self.rank, "failures": self.failures, "counts": self.counts}


# -- redistribution cases -------------------------------------------------------------------

def _case_1d(mesh, shape, src, dst, seed):
    from shardtensor import distribute_tensor

    full = _dense(shape, seed)
    x = distribute_tensor(full, mesh, src)
    _check_dtensor(x, full, src, what=f"distribute {src}")
    y = x.redistribute(mesh, dst)
    _check_dtensor(y, full, dst, what=f"{src}->{dst}")
    _check_dtensor(x, full, src, what=f"source after {src}->{dst}")  # the source is untouched


def _case_partial(mesh, shape, op, dst, seed):
    x, dense = _partial_source(mesh, shape, op, seed, mesh.ndim)
    y = x.redistribute(mesh, dst)
    _check_dtensor(y, dense, dst, what=f"P({op})->{dst}")


def _case_order(mesh, shape, seed):
    """Nested sharding with a non-default order: R,R -> S0,S0 order {0:[1,0]} -> default -> R,R."""
    from shardtensor import Replicate, Shard, distribute_tensor

    full = _dense(shape, seed)
    x = distribute_tensor(full, mesh, [Replicate(), Replicate()])
    nested = [Shard(0), Shard(0)]
    y = x.redistribute(mesh, nested, shard_order={0: [1, 0]})
    _check_dtensor(y, full, nested, order={0: [1, 0]}, what="RR->S0S0 order (1,0)")
    z = y.redistribute(mesh, nested)  # back to the default order (0,1)
    _check_dtensor(z, full, nested, order={0: [0, 1]}, what="S0S0 order (1,0)->(0,1)")
    w = z.redistribute(mesh, nested, shard_order={0: [1, 0]})
    _check_dtensor(w, full, nested, order={0: [1, 0]}, what="S0S0 order (0,1)->(1,0)")
    r = w.redistribute(mesh, [Replicate(), Replicate()])
    _check_dtensor(r, full, [Replicate(), Replicate()], what="S0S0 order (1,0)->RR")


def _redistribute_cases(rep, mesh1, mesh2):
    from shardtensor import Partial, Replicate, Shard

    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    for i, shape in enumerate(SHAPES):
        seed = 100 + i
        for name, src, dst in [("S0->R", [S0], [R]), ("S0->S1", [S0], [S1]), ("R->S1", [R], [S1]),
                               ("S1->S0", [S1], [S0])]:
            rep.run("redistribute_1d", f"{name} {shape}", _case_1d, mesh1, shape, src, dst, seed)
        for op, dst in [("sum", [R]), ("sum", [S0]), ("max", [R]), ("avg", [R]), ("sum", [S1]), ("min", [S0])]:
            rep.run("redistribute_1d", f"P({op})->{dst} {shape}", _case_partial, mesh1, shape, op, dst, seed)
        for name, src, dst in [("(S0,S0)->(R,S0)", [S0, S0], [R, S0]), ("(S0,S1)->(S1,S0)", [S0, S1], [S1, S0]),
                               ("(S0,S0)->(S0,R)", [S0, S0], [S0, R]), ("(S0,S1)->(R,R)", [S0, S1], [R, R]),
                               ("(R,S0)->(S1,S1)", [R, S0], [S1, S1])]:
            rep.run("redistribute_2d", f"{name} {shape}", _case_1d, mesh2, shape, src, dst, seed)
        rep.run("redistribute_2d", f"(P,P)->(R,R) {shape}", _case_partial, mesh2, shape, "sum", [R, R], seed)
        rep.run("redistribute_2d", f"(P,P)->(S0,S0) {shape}", _case_partial, mesh2, shape, "sum", [S0, S0], seed)
        rep.run("redistribute_2d", f"nested order {shape}", _case_order, mesh2, shape, seed)


# -- bytes recorded for the collectives ------------------------------------------------------

def _events_of(fn):
    from shardtensor import comm

    with comm.recording() as log:
        out = fn()
    return out, log.events


def _check_bytes_all_gather(mesh1):
    import torch
    from shardtensor import Replicate, Shard, distribute_tensor

    full = _dense((7, 5), 7)
    x = distribute_tensor(full, mesh1, [Shard(0)])
    _, ev = _events_of(lambda: x.redistribute(mesh1, [Replicate()]))
    assert [e.kind for e in ev] == ["all_gather"], ev
    e = ev[0]
    piece = 2 * 5 * 4  # padded piece: ceil(7/4)=2 rows of 5 float32
    assert (e.bytes_sent, e.bytes_received) == (3 * piece, 3 * piece), e
    assert e.rank == torch.distributed.get_rank() and e.group == (0, 1, 2, 3) and e.mesh_dim == 0, e
    assert "gloo" in e.backend, e


def _check_bytes_all_to_all(mesh1):
    import torch
    from shardtensor import Shard, distribute_tensor

    full = _dense((7, 5), 8)
    x = distribute_tensor(full, mesh1, [Shard(0)])
    _, ev = _events_of(lambda: x.redistribute(mesh1, [Shard(1)]))
    assert [e.kind for e in ev] == ["all_to_all"], ev
    e = ev[0]
    block = 2 * 2 * 4  # ceil(7/4) x ceil(5/4) float32 block to each peer
    assert (e.bytes_sent, e.bytes_received) == (3 * block, 3 * block), e
    assert e.rank == torch.distributed.get_rank() and e.group == (0, 1, 2, 3), e


def _check_bytes_reduce_scatter(mesh1):
    from shardtensor import Shard

    x, _ = _partial_source(mesh1, (7, 5), "sum", 9, 1)
    _, ev = _events_of(lambda: x.redistribute(mesh1, [Shard(0)]))
    assert [e.kind for e in ev] == ["reduce_scatter"], ev
    piece = 2 * 5 * 4
    assert (ev[0].bytes_sent, ev[0].bytes_received) == (3 * piece, 3 * piece), ev[0]


def _check_bytes_2d_all_gather(mesh2):
    from shardtensor import Replicate, Shard, distribute_tensor

    full = _dense((7, 4), 10)
    x = distribute_tensor(full, mesh2, [Shard(0), Shard(0)])
    _, ev = _events_of(lambda: x.redistribute(mesh2, [Shard(0), Replicate()]))
    assert [(e.kind, e.mesh_dim) for e in ev] == [("all_gather", 1)], ev
    coord = mesh2.get_coordinate()
    rows = 2  # the mesh-dim-1 group sees 4 (c0=0) or 3 (c0=1) rows; padded piece = 2 rows
    assert ev[0].bytes_sent == 1 * rows * 4 * 4, (coord, ev[0])
    assert set(ev[0].group) == {2 * coord[0], 2 * coord[0] + 1}, ev[0]


# -- backward --------------------------------------------------------------------------------

def _case_backward(mesh, shape, src, dst, seed, n_backward_gathers):
    import torch
    from shardtensor import Replicate, distribute_tensor

    full = _dense(shape, seed)
    W = _dense(shape, seed + 1)
    x = distribute_tensor(full.clone().requires_grad_(True), mesh, src)
    assert x.requires_grad
    y = x.redistribute(mesh, dst)
    loss = (y.full_tensor() * W).sum()
    _, ev = _events_of(loss.backward)
    assert torch.equal(loss.detach(), (full * W).sum())
    g = x.grad
    assert g is not None, "no gradient reached the DTensor input"
    want_pl = [Replicate() if p.is_partial() else p for p in src]
    _check_dtensor(g, W, want_pl, what=f"grad of {src}->{dst}")
    kinds = [e.kind for e in ev]
    assert kinds.count("all_gather") == n_backward_gathers and len(kinds) == n_backward_gathers, kinds


def _case_stale_write(mesh, placements, write):
    """A tensor saved for backward, then written (a foreach op, a fused AdamW step): backward
    raises on every rank, as on one device, instead of using the new values."""
    import torch
    from shardtensor import distribute_tensor

    w = distribute_tensor(_dense((7, 5), 230), mesh, placements).requires_grad_()
    loss = (w * w).sum()
    if write == "foreach":
        torch._foreach_mul_([w.detach()], 3.0)
    else:
        w.grad = torch.ones_like(w)
        torch.optim.AdamW([w], lr=0.1, fused=True).step()
    try:
        loss.backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e), e
    else:
        raise AssertionError(f"backward used the values {write} wrote")


def _backward_cases(rep, mesh1, mesh2):
    from shardtensor import Replicate, Shard

    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    for i, shape in enumerate([(8, 4), (7, 5)]):
        # S0 -> R: the gradient arrives R and is chunked (no collective)
        rep.run("backward", f"S0->R {shape}", _case_backward, mesh1, shape, [S0], [R], 200 + i, 0)
        # R -> S0: y.full_tensor()'s backward chunks; the redistribute's backward all-gathers once
        rep.run("backward", f"R->S0 {shape}", _case_backward, mesh1, shape, [R], [S0], 210 + i, 1)
        # 2-D: (S0,S1) -> (R,R): the gradient arrives replicated, chunked on both mesh dims
        rep.run("backward", f"(S0,S1)->(R,R) {shape}", _case_backward, mesh2, shape, [S0, S1], [R, R], 220 + i, 0)
    rep.run("backward", "foreach write into a saved S0 tensor", _case_stale_write, mesh1, [S0], "foreach")
    rep.run("backward", "fused AdamW step on a saved (S0,S1) tensor", _case_stale_write, mesh2, [S0, S1], "fused")


# -- elementwise ----------------------------------------------------------------------------

def _case_elementwise_1d(mesh1):
    import torch
    from shardtensor import Replicate, Shard, distribute_tensor

    X, Y = _dense((7, 5), 300), _dense((5,), 301)
    x = distribute_tensor(X, mesh1, [Shard(0)])
    y = distribute_tensor(Y, mesh1, [Replicate()])
    z, ev = _events_of(lambda: (x * 2 + y).relu())
    _check_dtensor(z, (X * 2 + Y).relu(), [Shard(0)], what="(S0*2 + R).relu()")
    assert ev == [], f"S0 op R needs no communication, got {[e.kind for e in ev]}"
    assert isinstance(z, torch.Tensor)


def _case_elementwise_2d(mesh2):
    from shardtensor import Partial, Replicate, distribute_tensor, Shard

    X, Y = _dense((7, 5), 302), _dense((5,), 303)
    x = distribute_tensor(X, mesh2, [Shard(0), Shard(1)])
    y = distribute_tensor(Y, mesh2, [Replicate(), Replicate()])
    z = (x * 2 + y).relu()
    assert not any(isinstance(p, Partial) for p in z.placements), z.placements
    _check_dtensor(z, (X * 2 + Y).relu(), list(z.placements), what=f"(S0,S1)*2+(R,R) -> {z.placements}")


def _case_partial_add(mesh, n):
    import torch
    from shardtensor import Partial

    a, A = _partial_source(mesh, (7, 5), "sum", 310, n)
    b, B = _partial_source(mesh, (7, 5), "sum", 311, n)
    c, ev = _events_of(lambda: a + b)
    c_full = c.full_tensor()
    # a non-linear op on a partial sum must reduce first, never apply to the terms
    r_full = (a + b).relu().full_tensor()
    s_full = (a * 3).full_tensor()
    assert tuple(c.placements) == (Partial("sum"),) * n, c.placements
    assert ev == [], f"P + P stays partial without communication, got {[e.kind for e in ev]}"
    assert torch.equal(c.to_local(), a.to_local() + b.to_local())
    assert torch.equal(c_full, A + B)
    assert torch.equal(r_full, (A + B).relu()), "relu of a Partial(sum) computed on the terms"
    assert torch.equal(s_full, A * 3)


def _elementwise_cases(rep, mesh1, mesh2):
    rep.run("elementwise", "(x*2+y).relu() S0,R", _case_elementwise_1d, mesh1)
    rep.run("elementwise", "(x*2+y).relu() (S0,S1),(R,R)", _case_elementwise_2d, mesh2)
    rep.run("elementwise", "P+P 1-D", _case_partial_add, mesh1, 1)
    rep.run("elementwise", "P+P 2-D", _case_partial_add, mesh2, 2)


# -- from_local(run_check=True) -------------------------------------------------------------

def _expect_value_error(fn, *needles):
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"ValueError message lacks {n!r}: {msg}"
        return msg
    raise AssertionError("no ValueError raised")


def _case_from_local_bad_shape(mesh1):
    import torch
    from shardtensor import DTensor, Shard

    # every rank holds 2 rows, but (7,5) over 4 ranks gives rank 3 one row
    local = torch.zeros(2, 5)
    _expect_value_error(lambda: DTensor.from_local(local, mesh1, [Shard(0)], run_check=True, shape=(7, 5)),
                        "rank 3", "(2, 5)", "(1, 5)")


def _case_from_local_bad_inferred(mesh1, run_check=True):
    import torch
    from shardtensor import DTensor, Shard

    rank = mesh1.get_rank()
    rows = [2, 3, 2, 1][rank]  # 8 rows in all: chunk rule gives 2,2,2,2
    _expect_value_error(lambda: DTensor.from_local(torch.zeros(rows, 5), mesh1, [Shard(0)], run_check=run_check),
                        "rank 1", "(3, 5)", "rank 3", "(1, 5)", "(2, 5)")


def _case_from_local_bad_replicate(mesh1):
    import torch
    from shardtensor import DTensor, Replicate

    rank = mesh1.get_rank()
    local = torch.zeros(4, 5) if rank != 2 else torch.zeros(4, 6)
    _expect_value_error(lambda: DTensor.from_local(local, mesh1, [Replicate()], run_check=True), "rank 2", "(4, 6)")


def _case_from_local_bad_ndim(mesh1, run_check=True):
    import torch
    from shardtensor import DTensor, Shard

    rank = mesh1.get_rank()
    local = torch.zeros(2, 5) if rank != 1 else torch.zeros(2, 5, 1)
    # the placement is validated against the local ndim first; Shard(0) is valid for both
    _expect_value_error(lambda: DTensor.from_local(local, mesh1, [Shard(0)], run_check=run_check), "ndim")


def _case_from_local_bad_2d(mesh2):
    import torch
    from shardtensor import DTensor, Shard

    rank = mesh2.get_rank()
    # (7,5) with (S0,S1) on 2x2: (4,3) (4,2) (3,3) (3,2); rank 2 wrongly holds 4 rows
    shapes = [(4, 3), (4, 2), (4, 3), (3, 2)]
    _expect_value_error(lambda: DTensor.from_local(torch.zeros(shapes[rank]), mesh2, [Shard(0), Shard(1)],
                                                   run_check=True, shape=(7, 5)),
                        "rank 2", "(4, 3)", "(3, 3)")


def _case_from_local_good(mesh1, mesh2, run_check=True):
    import torch
    from shardtensor import DTensor, Replicate, Shard

    rank = mesh1.get_rank()
    full = _dense((7, 5), 400)
    piece = torch.chunk(full, 4, dim=0)[rank].clone()
    x = DTensor.from_local(piece, mesh1, [Shard(0)], run_check=run_check)  # global shape inferred: 7 rows
    _check_dtensor(x, full, [Shard(0)], what="from_local uneven, inferred shape")
    x = DTensor.from_local(piece, mesh1, [Shard(0)], run_check=True, shape=(7, 5))
    _check_dtensor(x, full, [Shard(0)], what="from_local uneven, given shape")
    # Replicate with run_check broadcasts group rank 0's data
    y = DTensor.from_local(torch.full((3,), float(rank)), mesh1, [Replicate()], run_check=True)
    assert torch.equal(y.to_local(), torch.zeros(3)), y.to_local()
    # 2-D, uneven on both dims, inferred global shape
    coord = mesh2.get_coordinate()
    p2 = _expected_local(full, mesh2.shape, coord, [Shard(0), Shard(1)]).clone()
    z = DTensor.from_local(p2, mesh2, [Shard(0), Shard(1)], run_check=run_check)
    _check_dtensor(z, full, [Shard(0), Shard(1)], what="from_local 2-D uneven, inferred shape")


def _case_from_local_bad_field(mesh1, field):
    import torch
    from shardtensor import DTensor, Shard

    rank = mesh1.get_rank()
    odd = rank == 2
    local = {"dtype": lambda: torch.zeros(2, 3, dtype=torch.float64 if odd else torch.float32),
             "requires_grad": lambda: torch.zeros(2, 3, requires_grad=odd),
             "memory layout": lambda: torch.zeros(3, 2).t() if odd else torch.zeros(2, 3)}[field]()
    _expect_value_error(lambda: DTensor.from_local(local, mesh1, [Shard(0)], run_check=True), field, "rank 2")


def _case_from_local_stride(mesh1):
    import torch
    from shardtensor import DTensor, Shard

    local = torch.zeros(2, 4, 8).permute(1, 2, 0)  # shape (4, 8, 2), stride (8, 1, 32)
    for rc in (None, False, True):
        x = DTensor.from_local(local, mesh1, [Shard(1)], run_check=rc)
        assert x.shape == (4, 32, 2) and x.stride() == (32, 1, 128), (rc, x.shape, x.stride())


def _case_distribute_partial(mesh1, mesh2):
    import torch
    from shardtensor import Partial, Shard, distribute_tensor

    full = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    for op in ("sum", "avg", "max", "min", "product"):
        x = distribute_tensor(full, mesh1, [Partial(op)])
        assert torch.equal(x.full_tensor(), full), op
    y = distribute_tensor(full, mesh2, [Shard(0), Partial("sum")])
    assert torch.equal(y.full_tensor(), full)


def _case_submesh():
    import torch
    from shardtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0, 2])
    member = mesh.get_coordinate() is not None
    full = torch.arange(12.0).reshape(4, 3)
    x = distribute_tensor(full, mesh, [Shard(0)])
    y = DTensor.from_local(torch.ones(2, 3), mesh, [Partial()], run_check=True)
    r = DTensor.from_local(torch.ones(3), mesh, [Replicate()], run_check=True)
    s, eq, mm = x.sum(), torch.equal(x, x), (x @ x.t()).redistribute(mesh, [Replicate()])
    if member:
        assert torch.equal(mm.to_local(), full @ full.t()) and eq is True
        assert s.full_tensor().item() == full.sum().item() and y.full_tensor().sum().item() == 12.0
        assert torch.equal(r.to_local(), torch.ones(3))
    else:
        assert x.to_local().shape == (0,) and y.to_local().shape == (0,) and r.to_local().shape == (0,)
        assert mm.to_local().shape == (0,) and mm.shape == (4, 4) and eq is True
        assert s.to_local().shape == () and s.full_tensor().item() == 0.0


def _from_local_cases(rep, mesh1, mesh2):
    rep.run("sub-mesh", "mesh over ranks 0 and 2", _case_submesh)
    for field in ("dtype", "requires_grad", "memory layout"):
        rep.run("from_local", f"run_check, {field} differs on rank 2", _case_from_local_bad_field, mesh1, field)
    rep.run("from_local", "global stride follows the local layout", _case_from_local_stride, mesh1)
    rep.run("distribute_tensor", "Partial placements, exact", _case_distribute_partial, mesh1, mesh2)
    rep.run("from_local", "shape given, rank 3 too big", _case_from_local_bad_shape, mesh1)
    rep.run("from_local", "inferred shape, ranks 1 and 3 off", _case_from_local_bad_inferred, mesh1)
    rep.run("from_local", "replicate, rank 2 differs", _case_from_local_bad_replicate, mesh1)
    rep.run("from_local", "ndim differs on rank 1", _case_from_local_bad_ndim, mesh1)
    rep.run("from_local", "2-D, rank 2 off", _case_from_local_bad_2d, mesh2)
    rep.run("from_local", "valid uneven locals", _case_from_local_good, mesh1, mesh2)
    # without run_check (and without shape=) the pieces' sizes are still gathered: a clear error on
    # every rank rather than an abort in the next collective, and uneven pieces get their real shape
    rep.run("from_local", "default, ranks 1 and 3 off", _case_from_local_bad_inferred, mesh1, None)
    rep.run("from_local", "default, ndim differs on rank 1", _case_from_local_bad_ndim, mesh1, None)
    rep.run("from_local", "default, valid uneven locals", _case_from_local_good, mesh1, mesh2, None)


def _case_rng(mesh, placements, rank_seeded):
    """A sharded nn.init equals one device's draw with the same seed, and every rank's generator
    stays in step (or, seeded per rank on purpose, keeps its own stream)."""
    import torch
    from shardtensor import distribute_tensor

    seed = 7 + (mesh.get_rank() if rank_seeded else 0)
    torch.manual_seed(seed)
    x = distribute_tensor(torch.zeros(7, 5), mesh, placements)
    torch.nn.init.normal_(x)
    later = torch.rand(4)
    full = x.full_tensor()
    torch.manual_seed(7)
    want = torch.zeros(7, 5).normal_()
    torch.manual_seed(seed)
    torch.zeros(7, 5).normal_()
    assert torch.equal(later, torch.rand(4)), "the generator did not advance as one device's"
    _check_dtensor(x, want, placements, what="nn.init.normal_")
    assert torch.equal(full, want)


def _case_loss_parallel(mesh, placements):
    """Cross-entropy on class-sharded logits inside loss_parallel equals dense, with its gradient."""
    import torch
    import torch.nn.functional as F
    from shardtensor import distribute_tensor
    from shardtensor.parallel import loss_parallel

    x = _dense((6, 11), 21)
    t = torch.arange(6) % 11
    xd = distribute_tensor(x, mesh, placements).requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(xd, t, label_smoothing=0.1)
        loss.backward()
    xr = x.clone().requires_grad_()
    want = F.cross_entropy(xr, t, label_smoothing=0.1)
    want.backward()
    got, grad = loss.full_tensor(), xd.grad.full_tensor()
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, xr.grad, rtol=1e-5, atol=1e-6)


def _case_get_group(mesh1, mesh2):
    """get_group / get_all_groups return torch.distributed groups with the ranks torch's own
    DeviceMesh gives (built here on the same processes); user collectives on them work."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    from shardtensor import init_device_mesh

    rank = dist.get_rank()
    ref2 = torch_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ours2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pairs = [(mesh1.get_group(), torch_mesh("cpu", (4,)).get_group())]
    pairs += list(zip(mesh2.get_all_groups(), ref2.get_all_groups()))
    pairs += [(ours2.get_group("tp"), ref2.get_group("tp")), (ours2["dp"].get_group(), ref2["dp"].get_group())]
    for got, want in pairs:
        ranks = dist.get_process_group_ranks(got)
        assert ranks == dist.get_process_group_ranks(want), (ranks, dist.get_process_group_ranks(want))
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=got)
        assert t.item() == sum(r + 1 for r in ranks), (t, ranks)
    one = init_device_mesh("cpu", (4, 1)).get_group(1)  # a mesh dim of size 1: a group of this rank alone
    assert dist.get_process_group_ranks(one) == [rank]
    _expect_value_error(lambda: mesh2.get_group(), "mesh_dim")


def _rng_cases(rep, mesh1, mesh2):
    from shardtensor import Replicate, Shard

    rep.run("rng", "(4,) S0, same seed", _case_rng, mesh1, [Shard(0)], False)
    rep.run("rng", "(2,2) S0 S1, same seed", _case_rng, mesh2, [Shard(0), Shard(1)], False)
    rep.run("rng", "(2,2) R S1, seeded per rank", _case_rng, mesh2, [Replicate(), Shard(1)], True)
    rep.run("loss_parallel", "(4,) S1", _case_loss_parallel, mesh1, [Shard(1)])
    rep.run("loss_parallel", "(2,2) S0 S1", _case_loss_parallel, mesh2, [Shard(0), Shard(1)])
    rep.run("api", "get_group, get_all_groups", _case_get_group, mesh1, mesh2)


def _cp_module():
    try:
        import test_context_parallel as m
    except ImportError:  # tests/ imported as a package
        import tests.test_context_parallel as m
    return m


def _case_cp_training(mesh1):
    """A torch-style training step inside context_parallel: losses equal one device's."""
    import pytest

    train_tiny = _cp_module().train_tiny
    assert train_tiny(mesh1, 13) == pytest.approx(train_tiny(None, 13), rel=1e-5, abs=1e-6)


def _cp_cases(rep, mesh1, mesh2):
    from shardtensor import Shard
    from shardtensor.cp import head_tail, per_document
    case_dtensor, case_ring = _cp_module().case_dtensor, _cp_module().case_ring
    rep.run("context_parallel", "(4,) ring, head-tail 13, GQA", case_ring, mesh1, head_tail(13, 4), True, True)
    rep.run("context_parallel", "(4,) gather, packed documents", case_ring, mesh1, per_document([5, 17, 3, 9], 4),
            True, True, "gather")
    rep.run("context_parallel", "(2,2) DTensor S0 S2", case_dtensor, mesh2, [Shard(0), Shard(2)], True, True)
    rep.run("context_parallel", "(4,) training in context_parallel", _case_cp_training, mesh1)


# -- the one big run ------------------------------------------------------------------------

def _all_checks_worker(rank, world_size):
    import torch
    from shardtensor import comm, init_device_mesh
    from shardtensor.comm.torchdist import TorchDistTransport

    assert world_size == WORLD
    torch.manual_seed(0)
    rep = _Report(rank)
    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2))

    def _transport():
        t = mesh1.transport
        assert isinstance(t, TorchDistTransport), type(t)
        assert t.rank == rank and t.world_size == WORLD and t.backend == "gloo", (t.rank, t.world_size, t.backend)
        assert mesh2.get_coordinate() == [rank // 2, rank % 2]
        assert comm.DEFAULT_TIMEOUT_S == float(os.environ["SHARDTENSOR_COMM_TIMEOUT"])
    rep.run("setup", "transport is torch.distributed/gloo", _transport)

    _redistribute_cases(rep, mesh1, mesh2)
    rep.run("bytes", "all_gather (4,) (7,5)", _check_bytes_all_gather, mesh1)
    rep.run("bytes", "all_to_all (4,) (7,5)", _check_bytes_all_to_all, mesh1)
    rep.run("bytes", "reduce_scatter (4,) (7,5)", _check_bytes_reduce_scatter, mesh1)
    rep.run("bytes", "all_gather mesh dim 1 of (2,2) (7,4)", _check_bytes_2d_all_gather, mesh2)
    _backward_cases(rep, mesh1, mesh2)
    _elementwise_cases(rep, mesh1, mesh2)
    _from_local_cases(rep, mesh1, mesh2)
    _rng_cases(rep, mesh1, mesh2)
    _cp_cases(rep, mesh1, mesh2)
    return rep.result()


@pytest.fixture(scope="module")
def gloo_report():
    """Every rank's report of the one spawned run (failures per section, case counts)."""
    results = run_multiprocess(_all_checks_worker, world_size=WORLD, timeout=100,
                               env={"SHARDTENSOR_COMM_TIMEOUT": "20"})
    return results


def _assert_section(reports, section):
    counts = {r["counts"].get(section, 0) for r in reports}
    assert counts and min(counts) > 0, f"section {section!r} ran no case"
    failed: dict[str, list[tuple[int, str]]] = {}
    for rank, r in enumerate(reports):
        for case, tb in r["failures"].get(section, []):
            failed.setdefault(case, []).append((rank, tb))
    if failed:
        lines = [f"{len(failed)} of {max(counts)} cases of {section!r} failed:"]
        for case, per_rank in failed.items():
            lines.append(f"- {case}: ranks {[r for r, _ in per_rank]}")
        for case, per_rank in failed.items():
            rank, tb = per_rank[0]
            lines.append(f"\n=== {case} (rank {rank}) ===\n{tb}")
        pytest.fail("\n".join(lines), pytrace=False)


def test_setup(gloo_report):
    assert [r["rank"] for r in gloo_report] == list(range(WORLD)), "results are not in rank order"
    _assert_section(gloo_report, "setup")


def test_redistribute_1d(gloo_report):
    """(4,) mesh: S0->R, S0->S1, R->S1, S1->S0, P(sum|max|avg)->R, P(sum|min)->S0, P(sum)->S1; 3 shapes."""
    _assert_section(gloo_report, "redistribute_1d")


def test_redistribute_2d(gloo_report):
    """(2,2) mesh: (S0,S0)->(R,S0), (S0,S1)->(S1,S0), (P,P)->(R,R)/(S0,S0), nested orders; 3 shapes."""
    _assert_section(gloo_report, "redistribute_2d")


def test_comm_bytes(gloo_report):
    """Recorded bytes of all_gather, all_to_all, reduce_scatter match the padded ring model."""
    _assert_section(gloo_report, "bytes")


def test_backward(gloo_report):
    _assert_section(gloo_report, "backward")


def test_elementwise(gloo_report):
    _assert_section(gloo_report, "elementwise")


def test_from_local_run_check(gloo_report):
    _assert_section(gloo_report, "from_local")


def test_rng(gloo_report):
    _assert_section(gloo_report, "rng")


def test_loss_parallel(gloo_report):
    _assert_section(gloo_report, "loss_parallel")


def test_context_parallel(gloo_report):
    """Ring attention, gathered keys over packed documents, the DTensor path and a training step."""
    _assert_section(gloo_report, "context_parallel")


def test_public_api_torch_users_call(gloo_report):
    _assert_section(gloo_report, "api")


# ---------------------------------------------------------------------------------------
# failure handling: a rank that dies or raises must end the others with an error
# ---------------------------------------------------------------------------------------

FAIL_TIMEOUT = 10  # SHARDTENSOR_COMM_TIMEOUT and init_process_group timeout in the children
MUST_FAIL_WITHIN = 30.0


def _victim_worker(rank, world_size, victim, mode, mesh_shape):
    import torch
    from shardtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    x = distribute_tensor(full, mesh, [Shard(0)] * len(mesh_shape))
    assert torch.equal(x.full_tensor(), full)  # one healthy round of collectives first
    if rank == victim:
        if mode == "exit":
            os._exit(1)
        if mode == "hang":
            time.sleep(300)
        raise ValueError(f"boom on rank {rank}")
    # the survivors enter collectives the victim never joins
    for _ in range(3):
        y = x.redistribute(mesh, [Replicate()] * len(mesh_shape))
        x = y.redistribute(mesh, [Shard(1)] * len(mesh_shape))
    return "finished without the victim"


def _assert_survivors_failed(outcomes, victim):
    died = outcomes[victim]
    report = "\n".join(o.summary() for o in outcomes)
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.status == "error", f"surviving rank {o.rank} did not fail with an error:\n{report}"
        assert o.seconds - died.seconds < MUST_FAIL_WITHIN, f"rank {o.rank} took too long to fail:\n{report}"


def test_dead_rank_ends_the_others():
    """A process that exits mid-run (before a collective) makes every other rank raise, not hang.

    The victim is rank 0, which also hosts the rendezvous store; the mesh is 2x2, so the
    survivors' collectives run on sub-groups as well as on the whole world.
    """
    victim, mesh_shape = 0, (2, 2)
    outcomes = run_multiprocess_outcomes(
        _victim_worker, world_size=WORLD, timeout=60, args=(victim, "exit", mesh_shape),
        env={"SHARDTENSOR_COMM_TIMEOUT": str(FAIL_TIMEOUT)}, init_timeout=FAIL_TIMEOUT)
    assert outcomes[victim].status == "exited" and outcomes[victim].exitcode == 1, outcomes[victim].summary()
    _assert_survivors_failed(outcomes, victim)


def test_raising_rank_ends_the_others():
    """A rank that raises a Python exception: the parent gets its traceback, the others fail."""
    victim = 1
    with pytest.raises(MultiprocessError) as ei:
        run_multiprocess(_victim_worker, world_size=WORLD, timeout=60, args=(victim, "raise", (4,)),
                         env={"SHARDTENSOR_COMM_TIMEOUT": str(FAIL_TIMEOUT)}, init_timeout=FAIL_TIMEOUT,
                         fail_fast_grace=None)
    msg = str(ei.value)
    assert f"rank {victim} failed" in msg and "boom on rank 1" in msg and "Traceback" in msg, msg
    assert "_victim_worker" in msg, msg  # the traceback is the rank's own
    outcomes = ei.value.outcomes
    assert outcomes[victim].status == "error"
    _assert_survivors_failed(outcomes, victim)


# -- a rank that hangs: the library's collective timeout must end the others ----------------

HANG_COMM_TIMEOUT = 5
HANG_RUN_TIMEOUT = 45


def test_hung_rank_times_out():
    """A rank that stays alive but never joins the collective: the others fail after
    SHARDTENSOR_COMM_TIMEOUT (given to ``new_group``; the default group's timeout is longer, so
    only the library's groups can end them); then the helper kills the sleeper.
    """
    victim = 3
    t0 = time.monotonic()
    with pytest.raises(MultiprocessError) as ei:
        run_multiprocess(_victim_worker, world_size=WORLD, timeout=HANG_RUN_TIMEOUT, args=(victim, "hang", (4,)),
                         env={"SHARDTENSOR_COMM_TIMEOUT": str(HANG_COMM_TIMEOUT)}, init_timeout=120,
                         fail_fast_grace=5)
    elapsed = time.monotonic() - t0
    outcomes = ei.value.outcomes
    report = "\n".join(o.summary() for o in outcomes)
    assert outcomes[victim].status == "killed", report
    assert elapsed < HANG_RUN_TIMEOUT, f"the run took {elapsed:.1f}s:\n{report}"
    survivors = [o for o in outcomes if o.rank != victim]
    for o in survivors:
        assert o.status == "error", f"rank {o.rank} did not fail by itself:\n{report}"
    # the first to fail was ended by the collective timeout; the rest may see its exit instead
    first = min(survivors, key=lambda o: o.seconds)
    assert any("timed out" in o.error.lower() or "timeout" in o.error.lower() for o in survivors), first.error


_FAKE_PG_SCRIPT = """
import warnings, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
warnings.simplefilter("error", FutureWarning)  # the renamed collectives must not be called by their old names
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
from shardtensor import comm, init_device_mesh
mesh = init_device_mesh("cpu", (4,))
t = torch.ones(4, 6)
shapes = [tuple(comm.reduce_scatter(t, op, mesh, 0).shape) for op in ("sum", "max", "avg")]
shapes.append(tuple(comm.reduce_scatter(t, "sum", mesh, 0, async_op=True).wait().shape))
shapes.append(tuple(comm.all_gather(torch.ones(6), mesh, 0).shape))
shapes.append(tuple(comm.all_gather(torch.ones(6), mesh, 0, async_op=True).wait().shape))
print(shapes)
"""


def test_tensor_collectives_on_a_non_gloo_backend():
    """The NCCL code path (reduce-scatter and all-gather of whole tensors) on torch's ``fake``
    backend: every torch version accepts the calls, and none warns of a deprecated name."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FAKE_PG_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[(6,), (6,), (6,), (6,), (4, 6), (4, 6)]"
