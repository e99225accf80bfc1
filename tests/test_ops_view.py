"""View ops, cat/stack, select/slice/split and the size arguments of view/factory ops.

Differential checks (``opcheck.check``) on meshes (4,) and (2,2) with lengths 8, 7 and 3 on
the sharded dims, Partial(sum)/Partial(max) inputs (data movement passes any partial), forward
and backward; explicit placement and communication assertions where shards must survive;
and the local sizes and strides each rank gets from the size arguments of view-like ops.
"""
from __future__ import annotations

import functools

import pytest
import torch

from opcheck import MESHES, data, gen, local_piece, placement_combos, run_recorded  # noqa: E402
from opcheck import check as _check  # noqa: E402

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh, run_spmd  # noqa: E402
from shardtensor.propagation.rules.factory import dense_stride_like  # noqa: E402
from shardtensor.propagation.rules.view import exact_prefix, view_groups  # noqa: E402

P2 = ("sum", "max")


def check(fn, values, mesh, *, partial=("sum",), limit=12, seed=0, **kw):
    """``opcheck.check`` over ``limit`` combos that always include all-Replicate."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)] + [
        x for v in values if isinstance(v, (list, tuple)) for x in v if isinstance(x, torch.Tensor)]
    if kw.get("combos") is not None:
        return _check(fn, values, mesh, seed=seed, **kw)
    combos = placement_combos(tensors, mesh, None, seed, partial)  # never mixes Partial kinds on one tensor
    if len(combos) > limit:
        import random
        allr = tuple(tuple(Replicate() for _ in mesh) for _ in tensors)
        combos = [allr] + random.Random(repr((seed, mesh))).sample([c for c in combos if c != allr], limit - 1)
    return _check(fn, values, mesh, combos=combos, seed=seed, **kw)


def _x(shape, tag="x"):
    return data("any", shape, gen((tag, shape)))


# -- differential: one-input views ------------------------------------------------------------

UNARY = {
    "view_split": ((8, 6), lambda t: t.view(4, 2, 6)),
    "view_merge_uneven": ((7, 2, 3), lambda t: t.view(7, 6)),
    "view_minus1": ((7, 6), lambda t: t.view(-1)),
    "view_mixed": ((3, 4, 2), lambda t: t.view(2, 6, 2)),
    "view_unit_dims": ((3, 1, 4), lambda t: t.view(1, 3, 4, 1)),
    "reshape_transposed": ((8, 3), lambda t: t.t().reshape(-1)),
    "flatten": ((3, 4, 2), lambda t: t.flatten(1)),
    "flatten_all": ((7, 2, 2), lambda t: t.flatten()),
    "unflatten": ((6, 7), lambda t: t.unflatten(0, (2, 3))),
    "expand": ((7, 1), lambda t: t.expand(7, 5)),
    "expand_new_dims": ((1, 3), lambda t: t.expand(2, 4, 3)),
    "expand_minus1": ((8, 1, 3), lambda t: t.expand(-1, 2, -1)),
    "transpose": ((7, 3, 2), lambda t: t.transpose(0, -1)),
    "t": ((8, 3), lambda t: t.t()),
    "permute": ((7, 3, 2), lambda t: t.permute(2, 0, 1)),
    "movedim": ((3, 8, 2), lambda t: t.movedim(0, -1)),
    "squeeze_all": ((7, 1, 3), lambda t: t.squeeze()),
    "squeeze_dim_not1": ((7, 3), lambda t: t.squeeze(0)),
    "squeeze_lead_unit": ((1, 7), lambda t: t.squeeze(0)),
    "unsqueeze": ((7, 3), lambda t: t.unsqueeze(-1)),
    "select_neg": ((7, 3, 2), lambda t: t.select(-2, -1)),
    "select": ((8, 3), lambda t: t[5]),
    "slice_step": ((7, 8), lambda t: t[1:6:2]),
    "slice_dim1": ((3, 8), lambda t: t[:, -5:]),
    "slice_whole": ((7, 3), lambda t: t[-7:100]),
    "narrow": ((8, 7), lambda t: t.narrow(1, 2, 4)),
    "split_with_sizes": ((8, 3), lambda t: t.split([2, 5, 1])),
    "split": ((7, 3), lambda t: t.split(3)),
    "chunk": ((3, 7), lambda t: t.chunk(3, dim=-1)),
    "unbind": ((3, 8), lambda t: t.unbind(0)),
    "tensor_split": ((7, 3), lambda t: t.tensor_split(2)),
}


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_view(mesh, name):
    shape, fn = UNARY[name]
    check(fn, [_x(shape, name)], mesh, partial=P2, limit=8, seed=name)


@pytest.mark.parametrize("mesh", MESHES)
def test_index_select(mesh):
    x = _x((7, 5))
    idx = torch.tensor([4, 0, 6, 4])
    check(lambda t, i: t.index_select(0, i), [x, idx], mesh, partial=[P2, ()], limit=10, grad=False)
    seen = check(lambda t, i: t.index_select(1, i), [x, torch.tensor([1, 3])], mesh, partial=[P2, ()], limit=10,
                 grad=False)
    for (pin, _), out in seen:
        for p, q in zip(pin, out):
            if isinstance(p, Shard) and p.dim == 0 or isinstance(p, Partial):
                assert q == p


# -- differential: lists and scatters ---------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
def test_cat(mesh):
    a, b = _x((7, 3), "a"), _x((7, 5), "b")
    seen = check(lambda u, v: torch.cat([u, v], -1), [a, b], mesh, partial=P2, limit=14)
    for pins, out in seen:
        assert not any(isinstance(p, Shard) and p.dim == 1 for p in out)
    c = _x((3, 3), "c")
    check(lambda u, v: torch.cat([u, v]), [a, c], mesh, partial=("sum",), limit=10)


@pytest.mark.parametrize("mesh", MESHES)
def test_cat_with_empty(mesh):
    a, b = _x((7, 3), "a"), _x((0, 3), "b")
    check(lambda u, w: torch.cat([u, w, u]), [a, b], mesh, partial=("sum",), limit=10)
    # a legacy 1-D empty input is skipped by cat; autograd hands it a plain zeros((0,)) gradient,
    # so it is an int tensor here (no gradient)
    e = torch.zeros(0, dtype=torch.int64)
    check(lambda u, v, w: torch.cat([u, v, w, u]), [a, e, b], mesh, partial=("sum",), limit=10)


@pytest.mark.parametrize("mesh", MESHES)
def test_stack(mesh):
    a, b = _x((7, 3), "a"), _x((7, 3), "b")
    seen = check(lambda u, v: torch.stack([u, v], -2), [a, b], mesh, partial=P2, limit=14)
    for pins, out in seen:
        if pins[0] == pins[1]:
            expect = tuple(Shard(p.dim + (p.dim >= 1)) if isinstance(p, Shard) else p for p in pins[0])
            assert out == expect, (pins, out)


# no backward for the scatters: their derivative formulas build plain at::zeros tensors that
# dispatch refuses to mix with DTensors (an engine limitation, not a rule)
@pytest.mark.parametrize("mesh", MESHES)
def test_slice_scatter(mesh):
    x, src = _x((8, 7), "x"), _x((8, 3), "s")
    check(lambda u, v: torch.slice_scatter(u, v, 1, 1, 7, 2), [x, src], mesh, partial=("sum",), limit=12,
          grad=False)
    whole = _x((8, 7), "w")
    seen = check(lambda u, v: torch.slice_scatter(u, v, 0), [x, whole], mesh, partial=("sum",), limit=10,
                 grad=False)
    for pins, out in seen:
        if pins[0] == pins[1]:
            assert out == pins[0]


@pytest.mark.parametrize("mesh", MESHES)
def test_select_scatter(mesh):
    x, src = _x((7, 3, 2), "x"), _x((7, 2), "s")
    check(lambda u, v: torch.select_scatter(u, v, 1, -1), [x, src], mesh, partial=("max",), limit=12,
          grad=False)


# -- explicit placements and communication ------------------------------------------------------

def test_a_gather_or_reduction_may_shard_a_kept_dim_instead():
    """Where a view must gather one dim or reduce a Partial, the engine may instead shard a dim
    the output keeps (an all-to-all; a reduce-scatter where the input is sharded on another mesh
    dim): ``squeeze_copy`` of a ``(Shard(3), Partial)`` input moves its shard to dim 0 and keeps
    the Partial (no all-gather of Partial pieces); ``select_scatter`` of ``(Shard(2), Partial)``
    reduce-scatters the Partial into dim 0; ``narrow`` of a sharded narrowed dim is an all-to-all.
    Each value is one device's."""
    x, src, y = _x((5, 1, 5, 1)), _x((5, 5, 5), "s"), _x((8, 12), "n")

    def body(mesh):
        def halves(t, d):  # a Partial on mesh dim 1: each of its two ranks holds half
            return DTensor.from_local(_local(t, mesh, [Shard(d), Replicate()]).to_local() / 2, mesh,
                                      [Shard(d), Partial()])
        xs, base = halves(x, 3), halves(src, 2)
        with comm.scope("squeeze"):
            a = torch.squeeze_copy(xs)
        row = distribute_tensor(src[:, 0], mesh, [Replicate(), Replicate()])
        with comm.scope("select_scatter"):
            b = torch.select_scatter(base, row, 1, 0)
        return (a.placements, a.full_tensor(), b.placements, b.full_tensor())

    out, events = run_recorded((2, 2), body)
    kinds = {s: {e.kind for e in events if s in e.scope} for s in ("squeeze", "select_scatter")}
    assert kinds == {"squeeze": {"all_to_all"}, "select_scatter": {"reduce_scatter"}}, kinds
    for pa, a, pb, b in out:
        assert pa == (Shard(0), Partial()) and pb == (Shard(2), Shard(0))
        assert torch.equal(a, torch.squeeze_copy(x))
        torch.testing.assert_close(b, torch.select_scatter(src, src[:, 0], 1, 0))

    def narrow(mesh):
        with comm.scope("narrow"):
            n = _local(y, mesh, [Shard(1)]).narrow(1, 2, 6)
        return n.placements, n.full_tensor()
    out, events = run_recorded((4,), narrow)
    assert {e.kind for e in events if "narrow" in e.scope} == {"all_to_all"}
    assert all(p == (Shard(0),) and torch.equal(n, y.narrow(1, 2, 6)) for p, n in out)




def _local(x, mesh, placements):
    """Each rank's piece without communication (src_data_rank=None)."""
    return distribute_tensor(x, mesh, placements, src_data_rank=None)


def test_view_keeps_shard_without_comm():
    x = _x((8, 6))

    def body(mesh):
        y = _local(x, mesh, [Shard(0)]).view(4, 2, 6)
        z = _local(x, mesh, [Shard(0)]).view(-1, 2, 6)
        return y.placements, tuple(y.to_local().shape), z.placements, y.to_local().clone()

    res, events = run_recorded((4,), body)
    assert not events
    for r, (pl, shape, pl2, local) in enumerate(res):
        assert pl == (Shard(0),) and pl2 == (Shard(0),) and shape == (1, 2, 6)
        torch.testing.assert_close(local, x.view(4, 2, 6)[r:r + 1])


def test_view_nested_and_uneven_exact():
    def body(mesh, x, pl, shape):
        y = _local(x, mesh, pl).view(shape)
        return y.placements, tuple(y.to_local().shape)

    res, events = run_recorded((2, 2), body, _x((8, 6)), [Shard(0), Shard(0)], (48,))
    assert not events and res[0][0] == (Shard(0), Shard(0)) and res[3][1] == (12,)
    res, events = run_recorded((4,), body, _x((7, 2)), [Shard(0)], (14,))
    assert not events and res[0][0] == (Shard(0),) and [r[1] for r in res] == [(4,), (4,), (4,), (2,)]
    res, events = run_recorded((4,), body, _x((3, 2)), [Shard(0)], (6,))
    assert not events and [r[1] for r in res] == [(2,), (2,), (2,), (0,)]
    res, _ = run_recorded((4,), body, _x((5, 2)), [Shard(0)], (10,))
    assert res[0][0] == (Replicate(),)
    res, _ = run_recorded((4,), body, _x((8,)), [Shard(0)], (2, 4))
    assert res[0][0] == (Replicate(),)
    res, _ = run_recorded((2, 2), body, _x((12,)), [Shard(0), Shard(0)], (6, 2))  # only the outer level is exact
    assert res[0][0] == (Shard(0), Replicate()) and all(r[1] == (3, 2) for r in res)
    check(lambda t: t.view(6, 2), [_x((12,))], (2, 2), combos=[((Shard(0), Shard(0)),), ((Shard(0), Partial()),)])


def test_transpose_stack_select_placements():
    x = _x((8, 6))

    def body(mesh):
        a = _local(x, mesh, [Shard(0)])
        b = _local(x, mesh, [Shard(1)])
        c = _local(_x((3, 7, 2)), mesh, [Shard(2)])
        return (a.transpose(0, 1).placements, a.t().placements, torch.stack([b, b], 0).placements,
                torch.stack([a, a], 0).placements, c.select(-2, -1).placements, torch.cat([a, a], 1).placements,
                c.permute(2, 0, 1).placements, c.unsqueeze(0).placements)

    res, events = run_recorded((4,), body)
    assert not events
    assert res[0] == ((Shard(1),), (Shard(1),), (Shard(2),), (Shard(1),), (Shard(1),), (Shard(0),), (Shard(0),),
                      (Shard(3),))


def test_select_broadcasts_one_row():
    x = _x((7, 5))

    def body(mesh, pl, order):
        d = _local(x, mesh, pl)
        if order:
            d = d.redistribute(mesh, pl, shard_order=order)
        with comm.CommLog(rank=mesh.get_rank()) as log:
            rows = [d.select(0, i) for i in (0, 3, -1)] + [d[:, 2].select(0, 6)]
        kinds = {e.kind for e in log.events if e.kind != "barrier"}
        return [(r.placements, r.full_tensor()) for r in rows], kinds

    for mesh, pl, order in [((4,), [Shard(0)], None), ((2, 2), [Shard(0), Shard(0)], {0: [1, 0]}),
                            ((2, 2), [Shard(0), Shard(1)], None)]:
        res, _ = run_recorded(mesh, body, pl, order)
        for rows, kinds in res:
            assert kinds == {"broadcast"}
            for (placements, full), expect in zip(rows, [x[0], x[3], x[-1], x[6, 2]]):
                assert not any(isinstance(p, Shard) and p.dim == 0 and expect.ndim == 0 for p in placements)
                torch.testing.assert_close(full, expect)


NESTED_OPS = {
    "view": lambda t: t.view(4, 2, 6),
    "flatten": lambda t: t.flatten(),
    "transpose": lambda t: t.t(),
    "unsqueeze": lambda t: t.unsqueeze(0),
    "expand": lambda t: t.unsqueeze(1).expand(8, 3, 6),
    "stack": lambda t: torch.stack([t, t], 1),
    "cat": lambda t: torch.cat([t, t], 1),
    "select": lambda t: t.select(1, 4),
    "split": lambda t: t.split([4, 2], 1)[1],
    "slice": lambda t: t[:, 1:],
    "squeeze": lambda t: t.unsqueeze(1).squeeze(1),
}


def test_non_default_shard_order():
    """Nested S(0) applied mesh dim 1 first: outputs carry the order, local pieces follow it."""
    x = _x((8, 6))

    def body(mesh):
        d = _local(x, mesh, [Shard(0), Shard(0)]).redistribute(mesh, [Shard(0), Shard(0)], shard_order={0: [1, 0]})
        out = {}
        for name, fn in NESTED_OPS.items():
            y = fn(d)
            with torch.no_grad():
                out[name] = (y.placements, y.shard_order, y.to_local().clone(), y.full_tensor())
        return tuple(mesh.get_coordinate()), out

    res, _ = run_recorded((2, 2), body)
    for coord, out in res:
        for name, (pl, order, local, full) in out.items():
            expect = NESTED_OPS[name](x)
            torch.testing.assert_close(full, expect, msg=name)
            torch.testing.assert_close(local, local_piece(expect, (2, 2), coord, pl, order), msg=name)
    assert res[0][1]["view"][:2] == ((Shard(0), Shard(0)), ((0, (1, 0)),))
    assert res[0][1]["transpose"][:2] == ((Shard(1), Shard(1)), ((1, (1, 0)),))


def test_squeeze_global_length_only():
    def body(mesh):
        y = _local(_x((7, 1)), mesh, [Shard(0)]).squeeze()
        z = _local(_x((1, 5)), mesh, [Shard(0)]).squeeze(0)
        return y.placements, tuple(y.to_local().shape), z.placements, z.full_tensor()

    res, _ = run_recorded((4,), body)
    assert [r[1] for r in res] == [(2,), (2,), (2,), (1,)]
    assert all(r[0] == (Shard(0),) for r in res)
    # z's dim 0 (one row, all on rank 0) is gone: its 5 values move to a shard of the remaining
    # dim (an all-to-all, cheaper than gathering them on every rank)
    assert all(r[2] == (Shard(0),) and torch.equal(r[3], _x((1, 5)).squeeze(0)) for r in res)


def test_split_outputs_and_partials():
    def body(mesh):
        x = DTensor.from_local(torch.ones(7, 4), mesh, [Partial("max")])
        return [p.placements for p in torch.split(x, [3, 1], dim=1)]

    res, events = run_recorded((4,), body)
    assert not events and res[0] == [(Partial("max"),), (Partial("max"),)]


# -- size arguments of view / factory ops: local sizes per rank --------------------------------------

def test_new_zeros_local_shapes():
    def body(mesh):
        x = _local(_x((7, 5)), mesh, [Shard(0)])
        y = x.new_zeros((7, 5))
        z = x.new_ones((3, 4))
        w = x.new_full((7, 5), 2.0)
        return (y.placements, tuple(y.to_local().shape), z.placements, tuple(z.to_local().shape),
                w.placements, tuple(w.to_local().shape), y.full_tensor(), z.full_tensor())

    res, _ = run_recorded((4,), body)
    assert [r[1] for r in res] == [(2, 5), (2, 5), (2, 5), (1, 5)]
    for r in res:
        assert r[0] == (Shard(0),) and r[2] == (Replicate(),) and r[3] == (3, 4) and r[4] == (Shard(0),)
        torch.testing.assert_close(r[6], torch.zeros(7, 5))
        torch.testing.assert_close(r[7], torch.ones(3, 4))
    assert [r[5] for r in res] == [(2, 5), (2, 5), (2, 5), (1, 5)]


def test_view_minus1_concrete_local_sizes():

    def body(mesh):
        x = _local(_x((7, 6)), mesh, [Shard(0)])
        y = x.view(-1, 3, 2)
        z = x.reshape(7, -1, 2)
        return y.placements, tuple(y.to_local().shape), tuple(z.to_local().shape)

    res, events = run_recorded((4,), body)
    assert not events
    assert [r[1] for r in res] == [(2, 3, 2)] * 3 + [(1, 3, 2)]
    assert [r[2] for r in res] == [(2, 3, 2)] * 3 + [(1, 3, 2)]


def test_new_empty_strided_uneven():
    def body(mesh):
        x = _local(_x((7, 5)), mesh, [Shard(0)])
        y = x.new_empty_strided((7, 5), (1, 7))
        z = x.new_empty_strided((7, 5), (5, 1))
        with torch.no_grad():  # to_local's autograd view re-derives the stride of a length-1 dim
                return (y.placements, tuple(y.stride()), tuple(y.to_local().shape), tuple(y.to_local().stride()),
                    tuple(z.to_local().stride()))

    res, _ = run_recorded((4,), body)
    for r, (pl, gstride, shape, stride, zstride) in enumerate(res):
        assert pl == (Shard(0),) and gstride == (1, 7)
        assert shape == ((2, 5) if r < 3 else (1, 5))
        assert stride == ((1, 2) if r < 3 else (1, 1))
        assert zstride == (5, 1)


def test_new_factories_differential():
    for mesh in MESHES:
        check(lambda t: t.new_zeros((3, 2)) + t.sum(), [_x((7, 5))], mesh, partial=P2, limit=6)
        check(lambda t: t.new_ones(t.shape) * t, [_x((7, 5))], mesh, partial=("sum",), limit=8)


# -- helpers, errors ---------------------------------------------------------------------------

def test_view_groups_and_exact_prefix():
    assert view_groups((8, 6), (4, 2, 6)) == [([0], [0, 1]), ([1], [2])]
    assert view_groups((3, 1, 4), (1, 12)) == [([0, 2], [1])]
    assert view_groups((0, 4), (4, 0)) is None
    assert exact_prefix(7, 2, 14, 1, [4]) == 1
    assert exact_prefix(5, 2, 10, 1, [4]) == 0
    assert exact_prefix(8, 6, 48, 1, [2, 2]) == 2
    assert exact_prefix(12, 1, 6, 2, [2, 2]) == 1
    assert dense_stride_like((2, 5), (1, 7)) == (1, 2)
    assert dense_stride_like((2, 1, 3), (3, 3, 1)) == (3, 3, 1)


def test_as_strided():
    """The identity view keeps the shards; any other view of a sharded, Partial or transposed
    tensor is taken of the gathered whole with the global strides, as a copy whose writes go back
    into the base (``as_strided_scatter``), as on one device."""
    full = _x((8, 6))

    def body(mesh):
        x = _local(full, mesh, [Shard(0)])
        y = torch.as_strided(x, (8, 6), (6, 1))
        out = [y.placements]
        for make, dense in [(lambda: _local(full, mesh, [Shard(0)]), full.clone()),
                            (lambda: _local(full, mesh, [Shard(0)]).t(), full.clone().t()),
                            (lambda: DTensor.from_local(full / 4, mesh, [Partial()]), full.clone())]:
            t = make()
            v = torch.as_strided(t, (3, 2), (1, 6), 2)
            same = torch.equal(v.full_tensor(), torch.as_strided(dense, (3, 2), (1, 6), 2))
            v.add_(1)
            torch.as_strided(dense, (3, 2), (1, 6), 2).add_(1)
            out.append((v.placements, same, torch.equal(t.full_tensor(), dense)))
        return out

    res, _ = run_recorded((4,), body)
    assert res[0] == [(Shard(0),)] + [((Replicate(),), True, True)] * 3


def view_stack_gloo(t):
    """Top-level (picklable) function for the gloo run."""
    v = t.view(-1, 2, 3)
    return torch.stack([v, v * 2], 1).permute(1, 0, 2, 3)[0, 1:], v[5]


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
def test_gloo_view_stack():
    check(view_stack_gloo, [_x((7, 6))], (4,), partial=("sum",), limit=2, world="gloo")


# -- OpInfo samples ------------------------------------------------------------------------------

OPINFO_NAMES = ("view", "reshape", "permute", "transpose", "t", "squeeze", "unsqueeze", "expand", "cat", "stack",
                "select", "narrow", "split", "unbind", "movedim", "flatten", "unflatten", "chunk", "view_as",
                "split_with_sizes", "hstack", "vstack", "squeeze_copy")


@functools.lru_cache(maxsize=1)
def _opinfo_samples() -> dict:
    """Up to two small samples per OpInfo of the family (op_db is imported lazily: it is slow)."""
    from torch.testing._internal.common_methods_invocations import op_db

    out: dict = {}
    for op in op_db:
        if op.name not in OPINFO_NAMES:
            continue
        taken = out.setdefault(op.name, [])
        for s in op.sample_inputs("cpu", torch.float32, requires_grad=False):
            if len(taken) == 2 * (1 + bool(op.variant_test_name)):
                break
            leaves = [s.input] if isinstance(s.input, torch.Tensor) else list(s.input)
            extra = [a for a in list(s.args) + list(s.kwargs.values()) if isinstance(a, torch.Tensor)]
            if any(t.numel() > 256 for t in leaves + extra) or any(t.ndim == 0 for t in extra):
                continue
            taken.append((op, s))
    return out


@pytest.mark.parametrize("name", OPINFO_NAMES)
def test_opinfo_samples(name):
    for op, sample in _opinfo_samples()[name]:
        args, kwargs = list(sample.args), dict(sample.kwargs)
        tensor_args = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def fn(x, *ts, op=op, args=args, kwargs=kwargs, tensor_args=tensor_args):
            a = list(args)
            for i, t in zip(tensor_args, ts):
                a[i] = t
            return op.op(x, *a, **kwargs)

        values = [sample.input] + [args[i] for i in tensor_args]
        inp = [v.detach().round() / 4 if isinstance(v, torch.Tensor) else [t.detach().round() / 4 for t in v]
               for v in values]
        legacy_empty = any(t.shape == (0,) for v in inp for t in ([v] if isinstance(v, torch.Tensor) else v))
        check(fn, inp, (4,), partial=("sum",), limit=4, seed=repr(sample)[:80], grad=not legacy_empty)


# -- flattens that keep a shard (no communication) ------------------------------------------------

def _moved(mesh_shape, full, placements, fn):
    def body(mesh):
        x = distribute_tensor(full, mesh, placements)
        with comm.recording() as log:
            y = fn(x)
        return y.placements, [e.kind for e in log.of_rank(mesh.get_rank())], y.full_tensor()
    return run_recorded(mesh_shape, body)[0]


@pytest.mark.parametrize("shape,placements,to,want", [
    ((5, 5, 5), (Shard(1),), (25, 5), ("SS", 0, 5)),  # each rank's piece of every row: packed
    ((5, 6, 5), (Shard(2),), (5, 30), ("SS", 1, 6)),
    ((5, 5, 5), (Shard(2),), (125,), ("SS", 0, 25)),
    ((3, 7, 2), (Shard(1),), (21, 2), ("SS", 0, 3)),  # uneven and empty pieces
])
def test_flattening_a_sharded_inner_dim_gives_a_packed_shard(shape, placements, to, want):
    full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    from shardtensor import StridedShard
    for pl, kinds, got in _moved((4,), full, placements, lambda x: x.reshape(to)):
        assert kinds == [] and pl == (StridedShard(want[1], want[2]),) and torch.equal(got, full.reshape(to))
    check(lambda t: t.reshape(to) * 2, [full], (4,), combos=[(placements,)], seed=("packed", shape))


def test_a_batched_matmul_over_two_sharded_batch_dims_moves_nothing():
    """PyTorch issue 167106: (2, 2, h) as (Shard(0), Shard(1)) on a (2, 2) mesh times a replicated
    (h, 1): the fold to (4, h), the mm and the unfold keep both shards; DTensor gathers."""
    v, s = data("any", (2, 2, 3), gen("167106v")), data("any", (3, 1), gen("167106s"))

    def body(mesh):
        vd, sd = distribute_tensor(v, mesh, [Shard(0), Shard(1)]), distribute_tensor(s, mesh, [Replicate()] * 2)
        with comm.recording() as log:
            o = vd @ sd
        return o.placements, log.of_rank(mesh.get_rank()), o.full_tensor()
    for pl, events, full in run_recorded((2, 2), body)[0]:
        assert pl == (Shard(0), Shard(1)) and events == [] and torch.allclose(full, v @ s)
    check(lambda a, b: a @ b, [v, s], (2, 2), combos=[((Shard(0), Shard(1)), (Replicate(), Replicate()))],
          seed="167106")
    x = data("any", (2, 2, 3), gen("chain"))
    check(lambda t: t.reshape(4, 3).reshape(2, 2, 3) + 1, [x], (2, 2),
          combos=[((Shard(0), Shard(1)),), ((Shard(1), Shard(0)),), ((Shard(0), Shard(2)),)], seed="chain")
