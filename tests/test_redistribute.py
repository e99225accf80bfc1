"""Redistribution in the simulated world, checked against the dense tensor.

The oracle is always the dense tensor: after any redistribution ``full_tensor()`` equals the
value before it, and every rank's local piece equals the slice that the chunk rule
(``placement.local_shape_and_offset``) assigns to it.  Values are small integers stored in
float32, so every reduction, partition (``V/k``) and average is exact and equality is exact.

Partial sources are built from per-rank terms generated identically on every rank from a
seeded generator; each rank picks its own term.  Many (source, target) pairs run inside one
``run_spmd`` call per (mesh, shape) so the file stays fast.

Collectives are observed with a per-rank listener on the comm recording point (``comm``
reports each event on the thread of the rank that ran it), so each rank sees exactly the
events of the code it wraps.
"""
from __future__ import annotations

import itertools
import math
import random
import threading
from contextlib import contextmanager

import pytest
import torch

from shardtensor import DTensor, DTensorSpec, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh, run_spmd
from shardtensor.mesh import DeviceMesh
from shardtensor.placement import default_shard_order, display, local_shape_and_offset
from shardtensor.redistribute import redistribute_local

pytestmark = pytest.mark.main_release  # our own algorithms: the main torch release runs them (tests/conftest.py)

R = Replicate()
S0, S1 = Shard(0), Shard(1)
PS = Partial("sum")


# ----------------------------------------------------------------------------------------------
# helpers (pure; no library redistribution involved)
# ----------------------------------------------------------------------------------------------

def dense(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-20, 21, tuple(shape), generator=g).to(torch.float32)


def expected_slice(full: torch.Tensor, mesh_shape, coord, placements, order=None) -> torch.Tensor:
    """The piece of ``full`` that the chunk rule (docs/placements.md) assigns to ``coord``."""
    shp, off = local_shape_and_offset(tuple(full.shape), tuple(mesh_shape), coord, placements, order)
    out = full
    for d, (s, o) in enumerate(zip(shp, off)):
        out = out.narrow(d, o, s)  # an empty piece reports offset == global length: narrow(d, L, 0)
    return out


def partial_term(full: torch.Tensor, mesh_shape, coord, placements, seed) -> torch.Tensor:
    """This rank's term of ``full`` over the Partial mesh dims (one reduce op for all of them).

    Terms are integers (or dyadic for avg) so the reduction is exact.  Every rank generates all
    terms from the same seed and picks its own, as a real program would.
    """
    pdims = [j for j, p in enumerate(placements) if isinstance(p, Partial)]
    if not pdims:
        return full
    ops = {placements[j].reduce_op for j in pdims}
    assert len(ops) == 1, "tests use one reduce op across partial mesh dims"
    op = ops.pop()
    G = math.prod(mesh_shape[j] for j in pdims)
    g = 0
    for j in pdims:
        g = g * mesh_shape[j] + coord[j]
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randint(-9, 10, (G, *full.shape), generator=gen).to(full.dtype)
    if op == "sum":
        terms = noise.clone()
        terms[G - 1] = full - noise[: G - 1].sum(0)
    elif op == "avg":
        terms = noise.clone()
        terms[G - 1] = G * full - noise[: G - 1].sum(0)
    elif op in ("max", "min"):
        win = torch.randint(0, G, tuple(full.shape), generator=gen)
        mag = noise.abs() + 1
        terms = full - mag if op == "max" else full + mag
        idx = torch.arange(G).view(G, *([1] * full.ndim))
        terms = torch.where(idx == win, full, terms)
    elif op == "product":
        signs = torch.where(noise >= 0, 1.0, -1.0).to(full.dtype)
        terms = signs.clone()
        terms[G - 1] = full * signs[: G - 1].prod(0)
    else:  # pragma: no cover
        raise AssertionError(op)
    return terms[g]


def spec_for(mesh, shape, placements, order=None, dtype=torch.float32) -> DTensorSpec:
    return DTensorSpec.build(mesh, placements, shape, None, dtype, order)


def make_source(full, mesh, placements, order=None, seed=1, requires_grad=False) -> DTensor:
    """A DTensor with the value ``full`` and the given placements/order, built without redistribution.

    Default order: ``DTensor.from_local`` (then ``detach().requires_grad_()`` for a leaf).
    Non-default order: from_local cannot set one, so the DTensor is wrapped directly.
    """
    coord = mesh.get_coordinate()
    spec = spec_for(mesh, full.shape, placements, order, full.dtype)
    term = partial_term(full, mesh.shape, coord, spec.placements, seed)
    local = expected_slice(term, mesh.shape, coord, spec.placements, spec.shard_order).clone()
    if spec.is_default_order:
        x = DTensor.from_local(local, mesh, spec.placements, shape=tuple(full.shape))
        if requires_grad:
            x = x.detach().requires_grad_()
    else:
        x = DTensor(local, spec, requires_grad=requires_grad)
    assert x.placements == spec.placements and x.shard_order == spec.shard_order
    return x


def order_kw(placements, order):
    """The ``shard_order=`` keyword for a target (None when it is the default order)."""
    if order is None or tuple(order) == default_shard_order(placements):
        return None
    return {d: list(js) for d, js in order}


@contextmanager
def rank_events():
    """Collect the CommEvents this rank (this thread) produces inside the block."""
    ident = threading.get_ident()
    events: list = []

    def on(ev):
        if threading.get_ident() == ident:
            events.append(ev)

    comm.add_listener(on)
    try:
        yield events
    finally:
        comm.remove_listener(on)


def all_orders(placements):
    """Every valid shard order of ``placements``."""
    by: dict[int, list[int]] = {}
    for j, p in enumerate(placements):
        if isinstance(p, Shard):
            by.setdefault(p.dim, []).append(j)
    dims = sorted(by)
    for combo in itertools.product(*[list(itertools.permutations(by[d])) for d in dims]):
        yield tuple((d, tuple(c)) for d, c in zip(dims, combo))


def normalized(placements):
    return tuple(R if isinstance(p, Partial) else p for p in placements)


def describe(src, so, dst, do):
    return f"{display(src, so)} -> {display(dst, do)}"


def enumerate_pairs(mesh_ndim, ndim, partial_ops=("sum",)):
    """Every (source, source order, target, target order) on a mesh of ``mesh_ndim`` dims.

    Sources: R, S(d) for every tensor dim, P(op) per mesh dim (one op per source); targets: R,
    S(d), or the source's own Partial on that mesh dim (the public call allows only that).
    """
    shards = [Shard(d) for d in range(ndim)]
    srcs = set()
    for op in partial_ops:
        for pl in itertools.product([R, Partial(op), *shards], repeat=mesh_ndim):
            srcs.add(pl)
    srcs = sorted(srcs, key=str)
    pairs = []
    for src in srcs:
        choices = [[R, *shards] + ([p] if isinstance(p, Partial) else []) for p in src]
        for so in all_orders(src):
            for dst in itertools.product(*choices):
                for do in all_orders(dst):
                    pairs.append((src, so, dst, do))
    return pairs


# ----------------------------------------------------------------------------------------------
# 1. round trips: every (source, target) pair, values and local pieces
# ----------------------------------------------------------------------------------------------

def _sweep_rank(mesh_shape, shape, pairs, seed):
    mesh = init_device_mesh("cpu", mesh_shape)
    coord = tuple(mesh.get_coordinate())
    full = dense(shape, seed)
    failures = []
    sources: dict = {}  # one source DTensor per (placements, order): redistribute never mutates it
    for src, so, dst, do in pairs:
        what = f"mesh {mesh_shape} shape {tuple(shape)}: {describe(src, so, dst, do)}"
        if (src, so) not in sources:
            sources[(src, so)] = make_source(full, mesh, src, so, seed=seed * 1000 + len(sources))
        x = sources[(src, so)]
        try:
            y = x.redistribute(mesh, dst, shard_order=order_kw(dst, do))
            got_full = y.full_tensor()
        except Exception as e:
            e.add_note(what)
            raise
        want_order = spec_for(mesh, shape, dst, do).shard_order
        if y.placements != tuple(dst) or y.shard_order != want_order:
            failures.append(f"{what}: result placements {display(y.placements, y.shard_order)}")
        if tuple(y.shape) != tuple(shape) or y.dtype != torch.float32:
            failures.append(f"{what}: result global shape {tuple(y.shape)} dtype {y.dtype}")
        if not torch.equal(got_full, full):
            failures.append(f"{what}: full_tensor differs from the dense tensor")
        loc = y.to_local()
        want_shape = local_shape_and_offset(shape, mesh_shape, coord, dst, want_order)[0]
        if tuple(loc.shape) != want_shape:
            failures.append(f"{what}: rank {coord} local shape {tuple(loc.shape)}, expected {want_shape}")
        elif not any(isinstance(p, Partial) for p in dst):
            if not torch.equal(loc, expected_slice(full, mesh_shape, coord, dst, want_order)):
                failures.append(f"{what}: rank {coord} local piece differs from its slice of the dense tensor")
        if src == tuple(dst) and so == want_order:
            if y._local_tensor is not x._local_tensor:
                failures.append(f"{what}: same spec must return the same local tensor object")
        elif (y._local_tensor.untyped_storage().nbytes() and x._local_tensor.untyped_storage().nbytes() and
              y._local_tensor.untyped_storage().data_ptr() == x._local_tensor.untyped_storage().data_ptr()):
            failures.append(f"{what}: rank {coord} result shares storage with the source")
    return failures


def _pairs_3d(ndim, part, parts):
    pairs = enumerate_pairs(3, ndim)
    return pairs[part::parts]


SWEEP_CASES = []
for _shape in [(8, 4), (7, 5), (13, 3), (3, 5), (5,), (1, 6)]:
    _ops = ("sum", "avg", "max", "min", "product")
    SWEEP_CASES.append(pytest.param((4,), _shape, enumerate_pairs(1, len(_shape), _ops), id=f"mesh4-{_shape}"))
for _shape in [(8, 4), (7, 5), (13, 3), (3, 5), (5,), (2, 3)]:
    SWEEP_CASES.append(pytest.param((2, 2), _shape, enumerate_pairs(2, len(_shape)), id=f"mesh2x2-{_shape}"))
SWEEP_CASES.append(pytest.param((2, 2), (7, 5), enumerate_pairs(2, 2, ("max",)), id="mesh2x2-(7, 5)-pmax"))
SWEEP_CASES.append(pytest.param((2, 2), (7, 5), enumerate_pairs(2, 2, ("avg",)), id="mesh2x2-(7, 5)-pavg"))
# (2,2,2): every pair of a 2-D tensor runs once, spread over three shapes (one even, two uneven).
for _i, _shape in enumerate([(13, 3), (8, 4), (3, 5)]):
    SWEEP_CASES.append(pytest.param((2, 2, 2), _shape, _pairs_3d(2, _i, 3), id=f"mesh2x2x2-{_shape}"))
# ... and every pair of a 1-D tensor once, spread over an uneven length with empty pieces and 13.
SWEEP_CASES.append(pytest.param((2, 2, 2), (5,), enumerate_pairs(3, 1)[0::2], id="mesh2x2x2-(5,)"))
SWEEP_CASES.append(pytest.param((2, 2, 2), (13,), enumerate_pairs(3, 1)[1::2], id="mesh2x2x2-(13,)"))


@pytest.mark.parametrize("mesh_shape,shape,pairs", SWEEP_CASES)
def test_round_trip_every_pair(mesh_shape, shape, pairs):
    results = run_spmd(_sweep_rank, math.prod(mesh_shape), mesh_shape, shape, pairs, 7)
    failures = sorted({f for r in results for f in r})
    assert not failures, f"{len(failures)} failures, e.g.:\n" + "\n".join(failures[:25])


def test_sweep_covers_nested_orders_and_partials():
    pairs = enumerate_pairs(3, 2)
    assert len(pairs) > 4000
    assert any(so == ((0, (2, 0, 1)),) for _, so, _, _ in pairs)
    assert any(do == ((0, (1, 0)), (1, (2,))) for _, _, _, do in pairs)
    assert any(all(isinstance(p, Partial) for p in src) for src, _, _, _ in pairs)


# ----------------------------------------------------------------------------------------------
# 2. backward: the gradient is W with the source placements (Partial -> Replicate)
# ----------------------------------------------------------------------------------------------

def _backward_rank(mesh_shape, shape, pairs, seed):
    mesh = init_device_mesh("cpu", mesh_shape)
    coord = tuple(mesh.get_coordinate())
    full = dense(shape, seed)
    W = dense(shape, seed + 1)
    failures = []
    for i, (src, so, dst, do) in enumerate(pairs):
        what = f"backward mesh {mesh_shape} shape {tuple(shape)}: {describe(src, so, dst, do)}"
        x = make_source(full, mesh, src, so, seed=seed * 1000 + i, requires_grad=True)
        try:
            y = x.redistribute(mesh, dst, shard_order=order_kw(dst, do))
            loss = (y.full_tensor() * W).sum()
            loss.backward()
        except Exception as e:
            e.add_note(what)
            raise
        g = x.grad
        want_pl = normalized(x.placements)
        if not isinstance(g, DTensor):
            failures.append(f"{what}: grad is {type(g).__name__}, not a DTensor")
            continue
        if g.placements != want_pl or g.shard_order != x.shard_order:
            failures.append(f"{what}: grad placements {display(g.placements, g.shard_order)}, expected "
                            f"{display(want_pl, x.shard_order)}")
            continue
        if g.dtype != torch.float32 or tuple(g.shape) != tuple(shape):
            failures.append(f"{what}: grad dtype {g.dtype} shape {tuple(g.shape)}")
        if not torch.equal(g.full_tensor(), W):
            failures.append(f"{what}: grad full_tensor differs from W")
        want_local = expected_slice(W, mesh_shape, coord, want_pl, x.shard_order)
        if not torch.equal(g.to_local(), want_local):
            failures.append(f"{what}: rank {coord} grad local piece differs from its slice of W")
    return failures


def _sample(pairs, n, seed):
    if len(pairs) <= n:
        return pairs
    return random.Random(seed).sample(pairs, n)


BACKWARD_CASES = []
for _shape in [(8, 4), (7, 5), (3, 5)]:
    BACKWARD_CASES.append(pytest.param((4,), _shape, enumerate_pairs(1, 2, ("sum", "avg", "max", "min")),
                                       id=f"mesh4-{_shape}"))
for _shape in [(8, 4), (7, 5)]:
    BACKWARD_CASES.append(pytest.param((2, 2), _shape, enumerate_pairs(2, 2), id=f"mesh2x2-{_shape}"))
for _i, _shape in enumerate([(8, 4), (13, 3)]):
    _p3 = enumerate_pairs(3, 2)
    BACKWARD_CASES.append(pytest.param((2, 2, 2), _shape, _sample(_p3, 300, _i), id=f"mesh2x2x2-{_shape}"))


@pytest.mark.parametrize("mesh_shape,shape,pairs", BACKWARD_CASES)
def test_backward_gradient_placements_and_values(mesh_shape, shape, pairs):
    results = run_spmd(_backward_rank, math.prod(mesh_shape), mesh_shape, shape, pairs, 11)
    failures = sorted({f for r in results for f in r})
    assert not failures, f"{len(failures)} failures, e.g.:\n" + "\n".join(failures[:25])


def test_backward_leaf_via_distribute_and_from_local():
    """Leaves made by distribute_tensor(...).detach().requires_grad_() and from_local(...) work too."""

    def fn():
        mesh = init_device_mesh("cpu", (2, 2))
        full, W = dense((7, 5), 3), dense((7, 5), 4)
        x = distribute_tensor(full, mesh, [S0, S1]).detach().requires_grad_()
        y = x.redistribute(mesh, [S1, R])
        (y.full_tensor() * W).sum().backward()
        assert isinstance(x.grad, DTensor) and x.grad.placements == (S0, S1)
        assert torch.equal(x.grad.full_tensor(), W)
        # a Partial leaf through from_local: grad labelled Replicate
        term = partial_term(full, mesh.shape, mesh.get_coordinate(), (PS, S0), seed=5)
        loc = expected_slice(term, mesh.shape, mesh.get_coordinate(), (PS, S0))
        xp = DTensor.from_local(loc.clone(), mesh, [PS, S0], shape=(7, 5)).detach().requires_grad_()
        yp = xp.redistribute(mesh, [S1, S0])
        (yp.full_tensor() * W).sum().backward()
        assert xp.grad.placements == (R, S0)
        assert torch.equal(xp.grad.full_tensor(), W)
        assert torch.equal(xp.grad.to_local(), expected_slice(W, mesh.shape, mesh.get_coordinate(), (R, S0)))

    run_spmd(fn, 4)


def _table_53_rank():
    """Spec 5.3 rows; the gradient arrives in the output's placements (loss through to_local)."""
    mesh = init_device_mesh("cpu", (4,))
    coord = mesh.get_coordinate()
    out = {}
    for name, src, dst, shape in [
        ("S->R", [S0], [R], (7, 3)),
        ("R->S", [R], [S0], (7, 3)),
        ("Sa->Sb", [S0], [S1], (7, 6)),
        ("P->R", [PS], [R], (7, 3)),
        ("P->S", [PS], [S0], (7, 3)),
    ]:
        full, W = dense(shape, 21), dense(shape, 22)
        x = make_source(full, mesh, src, requires_grad=True)
        y = x.redistribute(mesh, dst)
        w_local = expected_slice(W, mesh.shape, coord, dst)
        loss = (y.to_local() * w_local).sum()
        with rank_events() as ev:
            loss.backward()
        g = x.grad
        out[name] = ([(e.kind, e.mesh_dim) for e in ev], g.placements,
                     torch.equal(g.full_tensor(), W),
                     torch.equal(g.to_local(), expected_slice(W, mesh.shape, coord, normalized(src))))
    # P -> R with the gradient arriving as P(sum) (on a 1-D mesh): all-reduce, labelled R
    full, W = dense((7, 3), 23), dense((7, 3), 24)
    x = make_source(full, mesh, [PS], requires_grad=True)
    y = x.redistribute(mesh, [R])
    w_term = partial_term(W, mesh.shape, coord, (PS,), seed=25)
    loss = (y.to_local(grad_placements=[PS]) * w_term).sum()
    with rank_events() as ev:
        loss.backward()
    out["P->R, grad P"] = ([(e.kind, e.mesh_dim) for e in ev], x.grad.placements,
                           torch.equal(x.grad.full_tensor(), W), torch.equal(x.grad.to_local(), W))
    return out


def test_backward_table_5_3():
    for res in run_spmd(_table_53_rank, 4):
        assert res["S->R"][:2] == ([], (S0,))  # T1 chunk, no communication
        assert res["R->S"][:2] == ([("all_gather", 0)], (R,))
        assert res["Sa->Sb"][:2] == ([("all_to_all", 0)], (S0,))
        assert res["P->R"][:2] == ([], (R,))  # grad arrives R: kept, labelled R
        assert res["P->S"][:2] == ([("all_gather", 0)], (R,))
        assert res["P->R, grad P"][:2] == ([("all_reduce", 0)], (R,))
        for name, (_, _, full_ok, local_ok) in res.items():
            assert full_ok and local_ok, name


@pytest.mark.parametrize("mesh_shape,placements", [((4,), [PS]), ((4,), [Partial("avg")]), ((2, 2), [S0, PS]),
                                                    ((2, 2), [PS, PS])])
def test_to_local_then_from_local_of_a_partial_is_the_identity_in_backward(mesh_shape, placements):
    """PyTorch issue 172932's pattern (MoE code): ``from_local(x.to_local(), placements)`` of a
    Partial ``x`` is the identity, so ``x.grad`` is the gradient of one device's loss (it came back
    summed once more, n times too large); an explicit ``grad_placements`` still wins."""
    full, W = dense((6, 5), 41), dense((6, 5), 42)

    def fn():
        mesh = init_device_mesh("cpu", mesh_shape)
        x = make_source(full, mesh, placements, requires_grad=True)
        grads = []
        for grad_placements in (None, placements):
            y = DTensor.from_local(x.to_local(grad_placements=grad_placements), mesh, placements,
                                   shape=full.shape, stride=full.stride())
            (y.full_tensor() * W).sum().backward()
            grads.append(x.grad.full_tensor())
            x.grad = None
        return grads

    n = math.prod(mesh_shape[j] for j, p in enumerate(placements) if p.is_partial())
    for default, explicit in run_spmd(fn, math.prod(mesh_shape)):
        assert torch.equal(default, W)  # as on one device
        # the Partial again: a sum's terms are summed once more, an average's are averaged
        assert torch.equal(explicit, W * n if placements[-1] == PS else W / n)


def test_to_local_of_a_partial_product_asks_for_grad_placements():
    def fn():
        mesh = init_device_mesh("cpu", (2,))
        x = DTensor.from_local(torch.ones(3), mesh, [Partial("product")]).detach().requires_grad_()
        x.to_local().sum().backward()

    with pytest.raises(NotImplementedError, match="grad_placements="):
        run_spmd(fn, 2)


def test_backward_2d_collectives():
    """(S0,S1) -> (R,R): backward only chunks; (R,R) -> (S0,S1): one all-gather per mesh dim."""

    def fn():
        mesh = init_device_mesh("cpu", (2, 2))
        full, W = dense((7, 5), 31), dense((7, 5), 32)
        res = {}
        for name, src, dst in [("SS->RR", [S0, S1], [R, R]), ("RR->SS", [R, R], [S0, S1])]:
            x = make_source(full, mesh, src, requires_grad=True)
            y = x.redistribute(mesh, dst)
            loss = (y.to_local() * expected_slice(W, mesh.shape, mesh.get_coordinate(), dst)).sum()
            with rank_events() as ev:
                loss.backward()
            res[name] = (sorted((e.kind, e.mesh_dim) for e in ev), x.grad.placements,
                         torch.equal(x.grad.full_tensor(), W))
        return res

    for res in run_spmd(fn, 4):
        assert res["SS->RR"] == ([], (S0, S1), True)
        assert res["RR->SS"] == ([("all_gather", 0), ("all_gather", 1)], (R, R), True)


# ----------------------------------------------------------------------------------------------
# 3. one row per transition
# ----------------------------------------------------------------------------------------------

def test_chunk_rule_and_local_shape_oracle():
    """The oracle itself (sections 1.2 and 1.4 examples) before anything relies on it."""
    from shardtensor.placement import chunk_sizes, chunk

    for L, sizes, offs in [(8, [2, 2, 2, 2], [0, 2, 4, 6]), (7, [2, 2, 2, 1], [0, 2, 4, 6]),
                           (6, [2, 2, 2, 0], [0, 2, 4, 6]), (5, [2, 2, 1, 0], [0, 2, 4, 5]),
                           (3, [1, 1, 1, 0], [0, 1, 2, 3]), (2, [1, 1, 0, 0], [0, 1, 2, 2])]:
        assert chunk_sizes(L, 4) == sizes
        assert [chunk(L, 4, r)[1] for r in range(4)] == offs
    coords = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    got = [local_shape_and_offset((7, 5), (2, 3), c, (S0, S1)) for c in coords]
    assert got == [((4, 2), (0, 0)), ((4, 2), (0, 2)), ((4, 1), (0, 4)),
                   ((3, 2), (4, 0)), ((3, 2), (4, 2)), ((3, 1), (4, 4))]
    assert local_shape_and_offset((3,), (4,), (3,), (S0,)) == ((0,), (3,))
    assert local_shape_and_offset((3,), (4,), None, (S0,)) == ((0,), ())


def _rows_1_to_3(shape):
    mesh = init_device_mesh("cpu", (4,))
    full = dense(shape, 1)
    x = make_source(full, mesh, [S0])
    src_rows = x.to_local().shape[0]
    with rank_events() as ev:
        y = x.redistribute(mesh, [R])
    return src_rows, [(e.kind, e.mesh_dim, e.group, e.bytes_sent, e.bytes_received, e.shape, e.dtype) for e in ev], \
        torch.equal(y.to_local(), full)


@pytest.mark.parametrize("shape,rows,piece", [((8, 3), [2, 2, 2, 2], (2, 3)), ((7, 3), [2, 2, 2, 1], (2, 3)),
                                              ((3, 5), [1, 1, 1, 0], (1, 5))])
def test_rows_1_2_3_shard_to_replicate(shape, rows, piece):
    res = run_spmd(_rows_1_to_3, 4, shape)
    assert [r[0] for r in res] == rows
    nbytes = 3 * math.prod(piece) * 4  # (k-1) padded pieces, fp32: 18 elements for (8,3)/(7,3)
    for src_rows, events, ok in res:
        assert ok
        assert events == [("all_gather", 0, (0, 1, 2, 3), nbytes, nbytes, piece, torch.float32)]
    if shape[1] == 3:
        assert nbytes == 18 * 4


def test_row_4_replicate_to_shard_no_collective_not_aliased():
    def fn():
        mesh = init_device_mesh("cpu", (4,))
        out = []
        for shape in [(7, 3), (5,)]:
            full = dense(shape, 2)
            x = distribute_tensor(full, mesh, [R])
            with rank_events() as ev:
                y = x.redistribute(mesh, [S0])
            loc = y.to_local()
            before = x.to_local().clone()
            same_storage = (loc.numel() > 0 and
                            loc.untyped_storage().data_ptr() == x._local_tensor.untyped_storage().data_ptr())
            with torch.no_grad():
                y._local_tensor.add_(1000)
            out.append((loc.shape[0], len(ev), same_storage, torch.equal(x.to_local(), before),
                        torch.equal(loc - 1000, expected_slice(full, mesh.shape, mesh.get_coordinate(), [S0]))))
        return out

    res = run_spmd(fn, 4)
    assert [r[0][0] for r in res] == [2, 2, 2, 1]
    assert [r[1][0] for r in res] == [2, 2, 1, 0]
    for per_rank in res:
        for rows, n_events, aliased, src_unchanged, ok in per_rank:
            assert n_events == 0 and not aliased and src_unchanged and ok


def _rows_5_6(shape, src, dst):
    mesh = init_device_mesh("cpu", (4,))
    full = dense(shape, 3)
    x = make_source(full, mesh, [src])
    with rank_events() as ev:
        y = x.redistribute(mesh, [dst])
    loc = y.to_local()
    return (tuple(loc.shape), torch.equal(loc, expected_slice(full, mesh.shape, mesh.get_coordinate(), [dst])),
            [(e.kind, e.mesh_dim, e.bytes_sent, e.bytes_received, e.shape) for e in ev])


def test_row_5_shard_to_shard_uneven_all_to_all():
    res = run_spmd(_rows_5_6, 4, (7, 6), S0, S1)
    assert [r[0] for r in res] == [(7, 2), (7, 2), (7, 2), (7, 0)]
    for _, ok, events in res:
        assert ok
        # one (2,2) block (4 elements) to each of 3 peers
        assert len(events) == 1 and events[0][:4] == ("all_to_all", 0, 3 * 4 * 4, 3 * 4 * 4)
        assert events[0][4] == (4, 2, 2)


def test_row_6_shard1_to_shard0_even():
    res = run_spmd(_rows_5_6, 4, (8, 8), S1, S0)
    for shape, ok, events in res:
        assert shape == (2, 8) and ok
        assert [e[:4] for e in events] == [("all_to_all", 0, 12 * 4, 12 * 4)]  # 4 per peer, 12 per rank


def _partial_to(op, dst, shape=(7, 3), seed=4):
    mesh = init_device_mesh("cpu", (4,))
    coord = mesh.get_coordinate()
    full = dense(shape, seed)
    x = make_source(full, mesh, [Partial(op)], seed=seed + 1)
    with rank_events() as ev:
        y = x.redistribute(mesh, [dst])
    loc = y.to_local()
    return (tuple(loc.shape), torch.equal(loc, expected_slice(full, mesh.shape, coord, [dst])),
            torch.equal(y.full_tensor(), full), [(e.kind, e.mesh_dim, e.bytes_sent, e.bytes_received) for e in ev],
            # the terms really differ across ranks (the op matters)
            not torch.equal(x.to_local(), full))


@pytest.mark.parametrize("op", ["sum", "max", "avg", "min", "product"])
def test_row_7_partial_to_replicate(op):
    res = run_spmd(_partial_to, 4, op, R)
    nbytes = 2 * 3 * 7 * 3 * 4 // 4  # 2(k-1)/k |X|, |X| = 7*3 fp32
    for shape, ok, full_ok, events, terms_differ in res:
        assert shape == (7, 3) and ok and full_ok
        assert events == [("all_reduce", 0, nbytes, nbytes)]
    assert any(r[4] for r in res)


@pytest.mark.parametrize("op", ["sum", "min", "max", "avg"])
def test_row_8_partial_to_shard(op):
    res = run_spmd(_partial_to, 4, op, S0)
    assert [r[0][0] for r in res] == [2, 2, 2, 1]
    nbytes = 3 * 2 * 3 * 4  # (k-1) padded pieces of 2 rows x 3 fp32 (7 rows padded to 8)
    for shape, ok, full_ok, events, _ in res:
        assert ok and full_ok
        assert events == [("reduce_scatter", 0, nbytes, nbytes)]


def test_row_9_internal_replicate_to_partial():
    def fn():
        mesh = init_device_mesh("cpu", (4,))
        full = dense((7, 3), 5)
        x = distribute_tensor(full, mesh, [R])
        out = {}
        for op in ["sum", "avg", "max", "min", "product"]:
            dst = x._spec.with_placements([Partial(op)])
            with rank_events() as ev:
                loc = redistribute_local(x.to_local(), x._spec, dst)
            out[op] = (loc.clone(), len(ev), torch.equal(DTensor(loc, dst).full_tensor(), full))
        return full, out, mesh.get_rank()

    for full, out, rank in run_spmd(fn, 4):
        # exact for any mesh size: the value on coordinate 0, -0.0 (the additive identity) elsewhere
        assert torch.equal(out["sum"][0], full if rank == 0 else torch.zeros_like(full))
        assert rank == 0 or bool(out["sum"][0].signbit().all())
        assert torch.equal(out["avg"][0], full)
        assert torch.equal(out["max"][0], full)
        assert torch.equal(out["min"][0], full)
        for op, (_, n_events, full_ok) in out.items():
            assert n_events == 0 and full_ok, op


def test_row_10_public_partial_target():
    def fn():
        mesh = init_device_mesh("cpu", (4,))
        full = dense((7, 3), 6)
        x = distribute_tensor(full, mesh, [R])
        with pytest.raises(RuntimeError):
            x.redistribute(mesh, [Partial()])
        with pytest.raises(RuntimeError):
            make_source(full, mesh, [S0]).redistribute(mesh, [Partial("sum")])
        p = make_source(full, mesh, [PS])
        with pytest.raises(RuntimeError):
            p.redistribute(mesh, [Partial("avg")])
        with rank_events() as ev:
            q = p.redistribute(mesh, [Partial("sum")])
        assert ev == [] and q._local_tensor is p._local_tensor and q.placements == (PS,)
        assert torch.equal(q.full_tensor(), full)

    run_spmd(fn, 4)


def test_row_11_internal_forward_shard_to_partial_raises():
    def fn():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(dense((7, 3), 7), mesh, [S0])
        with pytest.raises(RuntimeError):
            redistribute_local(x.to_local(), x._spec, x._spec.with_placements([PS]))

    run_spmd(fn, 4)


def test_row_12_internal_sum_avg_rescale():
    def fn():
        mesh = init_device_mesh("cpu", (4,))
        full = dense((7, 3), 8)
        x = make_source(full, mesh, [PS], seed=9)
        dst = x._spec.with_placements([Partial("avg")])
        with rank_events() as ev:
            loc = redistribute_local(x.to_local(), x._spec, dst)
        assert ev == []
        assert torch.equal(loc, x.to_local() * 4)
        assert torch.equal(DTensor(loc, dst).full_tensor(), full)
        back = redistribute_local(loc, dst, x._spec)
        assert torch.equal(back, x.to_local())
        assert torch.equal(DTensor(back, x._spec).full_tensor(), full)

    run_spmd(fn, 4)


def _pieces_2x2(shape, placements, order=None, via_redistribute=False):
    mesh = init_device_mesh("cpu", (2, 2))
    full = dense(shape, 10)
    if via_redistribute:
        x = distribute_tensor(full, mesh, placements).redistribute(mesh, placements, shard_order=order)
    else:
        x = distribute_tensor(full, mesh, placements)
    loc = x.to_local()
    _, off = x._spec.local_shape_and_offset()
    rows = loc.shape[0]
    return tuple(mesh.get_coordinate()), rows, off[0], torch.equal(loc, full[min(off[0], shape[0]):][:rows])


def test_row_13_distribute_nested():
    res = run_spmd(_pieces_2x2, 4, (7, 4), [S0, S0])
    assert [(r[1], r[2]) for r in res] == [(2, 0), (2, 2), (2, 4), (1, 6)]
    assert all(r[3] for r in res)


def test_row_14_nested_orders():
    res = run_spmd(_pieces_2x2, 4, (5, 4), [S0, S0])
    assert [r[0] for r in res] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(r[1], r[2]) for r in res] == [(2, 0), (1, 2), (1, 3), (1, 4)]
    assert all(r[3] for r in res)
    res = run_spmd(_pieces_2x2, 4, (5, 4), [S0, S0], {0: [1, 0]}, True)
    assert [(r[1], r[2]) for r in res] == [(2, 0), (1, 3), (1, 2), (1, 4)]
    assert all(r[3] for r in res)


def test_row_15_nested_empty_pieces():
    res = run_spmd(_pieces_2x2, 4, (2, 4), [S0, S0])
    assert [(r[1], r[2]) for r in res] == [(1, 0), (0, 2), (1, 1), (0, 2)]
    assert all(r[3] for r in res)


def _row_pair(mesh_shape, shape, src, dst, src_order=None, dst_order=None, seed=12):
    mesh = init_device_mesh("cpu", mesh_shape)
    coord = tuple(mesh.get_coordinate())
    full = dense(shape, seed)
    x = make_source(full, mesh, src, src_order, seed=seed + 1)
    with rank_events() as ev:
        y = x.redistribute(mesh, dst, shard_order=dst_order)
    loc = y.to_local()
    order = y.shard_order
    ok = torch.equal(loc, expected_slice(full, mesh_shape, coord, dst, order)) if not any(
        isinstance(p, Partial) for p in dst) else True
    return dict(coord=coord, shape=tuple(loc.shape), offset=y._spec.local_shape_and_offset()[1], ok=ok,
                full=torch.equal(y.full_tensor(), full), events=[(e.kind, e.mesh_dim) for e in ev],
                placements=y.placements, order=order)


def test_row_16_nested_to_replicate_shard_dense():
    res = run_spmd(_row_pair, 4, (2, 2), (7, 4), [S0, S0], [R, S0])
    assert [r["shape"][0] for r in res] == [4, 3, 4, 3]  # rows 4 (c1=0), 3 (c1=1)
    assert all(r["ok"] and r["full"] for r in res)


def test_row_17_nested_inner_all_gather():
    res = run_spmd(_row_pair, 4, (2, 2), (7, 4), [S0, S0], [S0, R])
    assert [r["shape"][0] for r in res] == [4, 4, 3, 3]
    for r in res:
        assert r["ok"] and r["full"]
        assert r["events"] == [("all_gather", 1)]


@pytest.mark.parametrize("shape,src,dst", [
    ((8, 8), [S0, S1], [S1, S0]),   # row 18
    ((8, 8), [S1, PS], [S0, S0]),   # row 20
    ((8, 8), [R, S0], [S1, S1]),    # row 21
    ((8, 5), [PS, S0], [R, R]),     # row 22
    ((7, 5), [S1, PS], [S0, S0]),
    ((7, 5), [S0, PS], [R, S0]),
    ((7, 5), [S0, S1], [R, S0]),
])
def test_rows_18_20_21_22_dense_equality(shape, src, dst):
    for r in run_spmd(_row_pair, 4, (2, 2), shape, src, dst):
        assert r["ok"] and r["full"] and r["placements"] == tuple(dst)


def test_row_19_two_reduce_scatters():
    res = run_spmd(_row_pair, 4, (2, 2), (8, 8), [PS, PS], [S0, S0])
    for r in res:
        assert r["ok"] and r["full"] and r["shape"] == (2, 8)
        assert r["events"] == [("reduce_scatter", 0), ("reduce_scatter", 1)]


def test_row_23_change_nested_order():
    res = run_spmd(_row_pair, 4, (2, 2), (8, 3), [S0, S0], [S0, S0], None, {0: [1, 0]})
    # order (1,0): mesh dim 1 splits first -> (0,0) 2@0, (0,1) 2@4, (1,0) 2@2, (1,1) 2@6
    assert [(r["coord"], r["shape"][0], r["offset"][0]) for r in res] == [
        ((0, 0), 2, 0), ((0, 1), 2, 4), ((1, 0), 2, 2), ((1, 1), 2, 6)]
    for r in res:
        assert r["ok"] and r["full"] and r["order"] == ((0, (1, 0)),)
    # and the 5-row table of 1.3
    res = run_spmd(_row_pair, 4, (2, 2), (5, 4), [S0, S0], [S0, S0], None, {0: [1, 0]})
    assert [(r["shape"][0], r["offset"][0]) for r in res] == [(2, 0), (1, 3), (1, 2), (1, 4)]
    assert all(r["ok"] and r["full"] for r in res)


def test_row_24_mesh_2x3():
    def fn():
        mesh = init_device_mesh("cpu", (2, 3))
        coord = tuple(mesh.get_coordinate())
        full = dense((7, 5), 13)
        out = []
        x = distribute_tensor(full, mesh, [S0, S1])
        out.append(tuple(x.to_local().shape))
        for src, dst in [((S0, S1), (S1, S0)), ((S1, S0), (S0, S1)), ((S0, S1), (R, R)), ((R, R), (S0, S1)),
                         ((S1, S0), (R, R)), ((R, R), (S1, S0))]:
            x = make_source(full, mesh, src)
            y = x.redistribute(mesh, dst)
            out.append((tuple(y.to_local().shape), torch.equal(y.to_local(), expected_slice(full, mesh.shape, coord, dst)),
                        torch.equal(y.full_tensor(), full)))
        return out

    res = run_spmd(fn, 6)
    assert [r[0] for r in res] == [(4, 2), (4, 2), (4, 1), (3, 2), (3, 2), (3, 1)]
    # (S1,S0): dim 1 (5) over 2 -> 3,2; dim 0 (7) over 3 -> 3,3,1
    assert [r[1][0] for r in res] == [(3, 3), (3, 3), (1, 3), (3, 2), (3, 2), (1, 2)]
    for r in res:
        for shape, ok, full_ok in r[1:]:
            assert ok and full_ok


def test_row_25_three_d_nested_orders():
    def fn():
        mesh = init_device_mesh("cpu", (2, 2, 2))
        full = torch.arange(13, dtype=torch.float32)
        x = distribute_tensor(full, mesh, [S0, S0, S0])
        y = x.redistribute(mesh, [S0, S0, S0], shard_order={0: [2, 0, 1]})
        z = y.redistribute(mesh, [S0, S0, S0])  # and back to the default order
        return [(t.to_local().shape[0], t._spec.local_shape_and_offset()[1][0], t.to_local().tolist(),
                 torch.equal(t.full_tensor(), full)) for t in (x, y, z)]

    res = run_spmd(fn, 8)
    default = [(2, 0), (2, 2), (2, 4), (1, 6), (2, 7), (1, 9), (2, 10), (1, 12)]
    order_201 = [(2, 0), (2, 7), (2, 2), (1, 9), (2, 4), (2, 10), (1, 6), (1, 12)]
    for which, table in [(0, default), (1, order_201), (2, default)]:
        assert [(r[which][0], r[which][1]) for r in res] == table
        for r, (n, off) in zip(res, table):
            assert r[which][2] == list(range(off, off + n)) and r[which][3]


def test_rows_29_31_backward():
    def fn(case):
        mesh = init_device_mesh("cpu", (4,))
        full = dense((8, 3), 14)
        src, dst = {"29": ([S0], [R]), "30": ([R], [S0]), "31": ([PS], [R])}[case]
        x = make_source(full, mesh, src, requires_grad=True)
        y = x.redistribute(mesh, dst)
        loss = y.full_tensor().sum()
        with rank_events() as ev:
            loss.backward()
        g = x.grad
        return [(e.kind, e.mesh_dim) for e in ev], g.placements, g.to_local().clone(), torch.equal(
            g.full_tensor(), torch.ones(8, 3))

    for events, pl, loc, ok in run_spmd(fn, 4, "29"):
        assert events == [] and pl == (S0,) and torch.equal(loc, torch.ones(2, 3)) and ok
    for events, pl, loc, ok in run_spmd(fn, 4, "30"):
        assert events == [("all_gather", 0)] and pl == (R,) and torch.equal(loc, torch.ones(8, 3)) and ok
    for events, pl, loc, ok in run_spmd(fn, 4, "31"):
        assert events == [] and pl == (R,) and torch.equal(loc, torch.ones(8, 3)) and ok


def _row_33(src, dst, backward_dtype):
    mesh = init_device_mesh("cpu", (4,))
    full, W = dense((8, 3), 15), dense((8, 3), 16)
    out = {}
    for fwd in (None, torch.bfloat16):
        x = make_source(full, mesh, src, requires_grad=True)
        with rank_events() as fev:
            y = x.redistribute(mesh, dst, forward_dtype=fwd, backward_dtype=backward_dtype)
        loss = (y.to_local().float() * expected_slice(W, mesh.shape, mesh.get_coordinate(), dst)).sum()
        with rank_events() as bev:
            loss.backward()
        out[fwd] = dict(
            fwd=[(e.kind, e.dtype, e.bytes_sent) for e in fev], bwd=[(e.kind, e.dtype, e.bytes_sent) for e in bev],
            y_dtype=y.dtype, y_local_dtype=y.to_local().dtype, y_full=torch.equal(y.full_tensor().float(), full),
            g_dtype=x.grad.dtype, g_local_dtype=x.grad.to_local().dtype, g_pl=x.grad.placements,
            g_ok=torch.equal(x.grad.full_tensor(), W))
    return out


def test_row_33_forward_dtype_s_to_r():
    for out in run_spmd(_row_33, 4, [S0], [R], None):
        ref, bf = out[None], out[torch.bfloat16]
        assert ref["fwd"] == [("all_gather", torch.float32, 72)]
        assert bf["fwd"] == [("all_gather", torch.bfloat16, 36)]  # forward bytes halved
        assert bf["y_dtype"] == bf["y_local_dtype"] == torch.bfloat16 and bf["y_full"]
        assert bf["bwd"] == []  # S0 -> R backward is a chunk
        assert bf["g_dtype"] == bf["g_local_dtype"] == torch.float32 and bf["g_pl"] == (S0,) and bf["g_ok"]


@pytest.mark.parametrize("backward_dtype", [None, torch.bfloat16])
def test_row_33_backward_dtype_r_to_s(backward_dtype):
    want = backward_dtype or torch.float32
    for out in run_spmd(_row_33, 4, [R], [S0], backward_dtype):
        bf = out[torch.bfloat16]
        assert bf["fwd"] == [] and bf["y_dtype"] == torch.bfloat16 and bf["y_full"]
        # the backward all-gather runs in the chosen dtype: 3 pieces of (2,3)
        assert bf["bwd"] == [("all_gather", want, 3 * 6 * want.itemsize)]
        assert bf["g_dtype"] == bf["g_local_dtype"] == torch.float32 and bf["g_pl"] == (R,) and bf["g_ok"]


def test_row_34_same_placements_identity():
    def fn():
        mesh = init_device_mesh("cpu", (2, 2))
        full = dense((7, 5), 17)
        out = []
        for pl, order in [([S0, S1], None), ([S0, S0], ((0, (1, 0)),)), ([PS, S1], None), ([R, R], None)]:
            x = make_source(full, mesh, pl, order)
            with rank_events() as ev:
                y = x.redistribute(mesh, pl, shard_order=order_kw(pl, order))
            with torch.no_grad():
                same_nograd = y.to_local() is x.to_local()
            out.append((len(ev), y._local_tensor is x._local_tensor, same_nograd, y.placements == x.placements,
                        y.shard_order == x.shard_order))
        return out

    for per_rank in run_spmd(fn, 4):
        for r in per_rank:
            assert r == (0, True, True, True, True)


def test_row_37_cross_mesh_moves():
    """Another mesh moves the tensor (tests/test_crossmesh.py has the random sweep); the
    same-mesh executor alone still refuses two meshes."""
    def fn():
        mesh = init_device_mesh("cpu", (4,))
        other = DeviceMesh("cpu", [3, 2, 1, 0])
        mesh2d = init_device_mesh("cpu", (2, 2))
        full = dense((8, 3), 18)
        x = distribute_tensor(full, mesh, [S0])
        assert torch.equal(x.redistribute(other, [R]).to_local(), full)
        y = x.redistribute(other, [S0])  # equal placements, other ranks: rank r gets piece 3 - r
        assert torch.equal(y.to_local(), full.chunk(4)[3 - mesh.get_rank()])
        z = x.redistribute(other, [S0], forward_dtype=torch.bfloat16)
        assert z.dtype == torch.bfloat16 and torch.equal(z.full_tensor(), full.to(torch.bfloat16))
        assert torch.equal(x.redistribute(mesh2d, [S0, R]).full_tensor(), full)
        with pytest.raises(NotImplementedError):
            redistribute_local(x.to_local(), x._spec, spec_for(other, (8, 3), [R]))

    run_spmd(fn, 4)


def test_row_38_size_one_mesh_dim():
    def fn():
        mesh = init_device_mesh("cpu", (1, 4))
        coord = tuple(mesh.get_coordinate())
        full = dense((7, 5), 19)
        out = []
        for src, dst in [([S0, R], [R, R]), ([R, R], [S0, R]), ([PS, R], [R, R]), ([S0, S1], [S1, S0]),
                         ([R, S0], [S0, S0]), ([S0, S0], [R, R]), ([PS, S0], [S1, R])]:
            x = make_source(full, mesh, src)
            with rank_events() as ev:
                y = x.redistribute(mesh, dst)
            out.append(([(e.kind, e.mesh_dim) for e in ev],
                        torch.equal(y.to_local(), expected_slice(full, mesh.shape, coord, dst)),
                        torch.equal(y.full_tensor(), full)))
        # a forward S -> P passes on a size-1 mesh dim (the step is the identity)
        x = make_source(full, mesh, [S0, R])
        dst = x._spec.with_placements([PS, R])
        with rank_events() as ev:
            loc = redistribute_local(x.to_local(), x._spec, dst)
        out.append((list(ev), torch.equal(loc, full), torch.equal(DTensor(loc, dst).full_tensor(), full)))
        return out

    for per_rank in run_spmd(fn, 4):
        for events, ok, full_ok in per_rank:
            assert ok and full_ok
            assert all(md == 1 for _, md in events), events  # nothing on the size-1 mesh dim 0
        assert per_rank[0][0] == [] and per_rank[1][0] == [] and per_rank[2][0] == []
        assert per_rank[7][0] == []
