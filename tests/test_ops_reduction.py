"""Reductions.

Differential checks against dense torch on meshes (4,) and (2, 2) with lengths 8, 7 and 3 on
the sharded dims (3 over 4 ranks leaves an empty shard), Partial inputs of every kind, forward
and backward, plus explicit assertions on the placements and collectives the rules choose.
"""
from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from opcheck import MESHES, check, data, gen, placement_combos  # noqa: E402

from shardtensor import (DTensor, Partial, Replicate, Shard, comm, distribute_tensor,  # noqa: E402
                         init_device_mesh, run_spmd)

aten = torch.ops.aten
SHAPES = [(8, 6), (7, 5), (3, 5)]
KINDS = ("sum", "avg", "max", "min", "product")


@pytest.fixture(autouse=True, scope="module")
def _quiet_degrees_of_freedom():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*degrees of freedom.*")
        yield


def one_kind_combos(tensors, mesh, kinds=KINDS, limit=8, seed=0) -> list:
    """Random placement combos with at most one Partial kind per tensor (all-R always kept)."""
    every = placement_combos(tensors, mesh, None, seed, kinds)
    ok = [c for c in every if all(len({p.reduce_op for p in pl if isinstance(p, Partial)}) <= 1 for pl in c)]
    rng = random.Random(repr((seed, mesh, [tuple(t.shape) for t in tensors])))
    picked = rng.sample(ok, min(limit, len(ok)))
    allr = tuple(tuple(Replicate() for _ in mesh) for _ in tensors)
    if allr not in picked:
        picked[-1] = allr
    return picked


def run(mesh_shape, body, *args):
    """``body(mesh, *args)`` on every simulated rank; rank 0's result."""
    n = math.prod(mesh_shape)
    return run_spmd(lambda: body(init_device_mesh("cpu", mesh_shape), *args), n, timeout=60)[0]


# -- differential: every op of the family ---------------------------------------------------

GROUPS = {
    # name: (fn returning several reductions of one input, data kind, backward)
    "sum": (lambda t: (t.sum(0), t.sum((0, 1)), t.sum(1, keepdim=True), aten.sum.dim_IntList(t, []), t.sum(),
                       t.sum(0, dtype=torch.float64), aten.nansum.default(t, [1])),
            "any", True),
    "mean": (lambda t: (t.mean(0), t.mean(), t.mean(-1, keepdim=True), t.mean((0, 1), keepdim=True)), "any", True),
    "prod": (lambda t: (t.prod(0), t.prod(), t.prod(1, keepdim=True)), "coarse", False),
    "amax": (lambda t: (t.amax(0), t.amin((0, 1), keepdim=True), t.max(), t.min(), t.amax()), "distinct", True),
    "max_dim": (lambda t: (*t.max(0), *t.min(1, keepdim=True)), "distinct", False),
    "argmax": (lambda t: (t.argmax(0), t.argmin(1, keepdim=True), t.argmax()), "distinct", False),
    "var": (lambda t: (t.var(0), t.var(correction=0), t.std(1, keepdim=True), t.std()), "any", True),
    "var_mean": (lambda t: (*torch.var_mean(t, 0), *torch.std_mean(t, (0, 1), keepdim=True, correction=0)),
                 "any", True),
    "scan": (lambda t: (t.cumsum(0), t.cumsum(1), torch.logcumsumexp(t, 1), *torch.cummax(t, 0),
                        *torch.cummin(t, 1)), "distinct", False),
    "cumprod": (lambda t: (t.cumprod(0), t.cumprod(1)), "coarse", False),
}


def any_all(t):
    return t.any(0), t.any(), aten.any.dims(t, [0, 1], True), t.all(1), t.all(), aten.all.dims(t, [0])


CASES = [((8, 6), (4,)), ((7, 5), (4,)), ((7, 5), (2, 2)), ((3, 5), (4,))]
"""Lengths 8, 7 (2,2,2,1 on four ranks, 4,3 on a mesh dim of two) and 3 (1,1,1,0: an empty shard);
nested shardings of 7 and 3 over (2, 2) are in the explicit tests below."""


@pytest.mark.parametrize("shape,mesh", CASES)
@pytest.mark.parametrize("name", list(GROUPS))
def test_float_reductions(name, shape, mesh):
    fn, kind, grad = GROUPS[name]
    x = data(kind, shape, gen((name, shape)))
    combos = one_kind_combos([x], mesh, limit=6, seed=name)
    check(fn, [x], mesh, combos=combos, seed=name, tol=dict(rtol=1e-4, atol=1e-4), grad=grad)


@pytest.mark.parametrize("shape,mesh", CASES)
def test_bool_and_int_any_all(shape, mesh):
    x = data("bool", shape, gen(("bool", shape)))
    check(any_all, [x], mesh, combos=one_kind_combos([x], mesh, ("max", "min"), limit=6, seed="bool"), grad=False)
    i = data("int", shape, gen(("int", shape)))
    check(any_all, [i], mesh, combos=one_kind_combos([i], mesh, ("sum", "max", "min"), limit=3, seed="int"),
          grad=False)


def test_zero_dim_and_int_inputs():
    x = torch.tensor(2.5)
    check(lambda t: (t.sum(), t.sum(0), t.amax(-1), t.mean([]), t.var(0, correction=0), t.cumsum(0)), [x], (2, 2),
          combos=one_kind_combos([x], (2, 2), ("sum", "max"), limit=6))
    i = data("int", (7, 5), gen("int"))
    check(lambda t: (t.sum(0), t.prod(1), t.amax(0), t.cumsum(0), t.argmax(0)), [i], (4,),
          combos=one_kind_combos([i], (4,), ("sum", "max", "min", "product"), limit=8), grad=False)


# -- placements ----------------------------------------------------------------------------

def _placements_and_comms(mesh_shape, x, in_pl, fn):
    def body(mesh):
        d = distribute_tensor(x, mesh, in_pl)
        with comm.CommLog(rank=mesh.get_rank()) as log:
            out = fn(d)
        outs = out if isinstance(out, tuple) else (out,)
        return [tuple(o.placements) for o in outs], [e.kind for e in log.events], [o.full_tensor() for o in outs]
    return run(mesh_shape, body)


def test_sum_placements_no_comm():
    x = data("any", (7, 5), gen("sum7"))
    pls, kinds, full = _placements_and_comms((4,), x, [Shard(0)], lambda t: t.sum(0))
    assert pls == [(Partial("sum"),)] and kinds == []
    torch.testing.assert_close(full[0], x.sum(0))
    assert _placements_and_comms((4,), x, [Shard(1)], lambda t: t.sum(0))[:2] == ([(Shard(0),)], [])
    assert _placements_and_comms((4,), x, [Shard(1)], lambda t: t.sum(0, keepdim=True))[:2] == ([(Shard(1),)], [])
    pls, kinds, full = _placements_and_comms((4,), x, [Shard(0)], lambda t: aten.sum.dim_IntList(t, []))
    assert pls == [(Partial("sum"),)] and kinds == [] and full[0].shape == ()
    y = data("any", (4, 6, 8), gen("sum3d"))
    for dims, keep, want in [([0], False, (Partial("sum"), Shard(1))), ([0], True, (Partial("sum"), Shard(2))),
                             ([1], False, (Shard(0), Shard(1))), ([1], True, (Shard(0), Shard(2)))]:
        pls, kinds, full = _placements_and_comms((2, 2), y, [Shard(0), Shard(2)], lambda t: t.sum(dims, keepdim=keep))
        assert pls == [want] and kinds == [], (dims, keep, pls)
        torch.testing.assert_close(full[0], y.sum(dims, keepdim=keep))


def test_sum_keeps_avg_and_refuses_max():
    x = data("any", (8, 6), gen("avg"))
    seen = check(lambda t: t.sum(1), [x], (4,), combos=[((Partial("avg"),),), ((Partial("max"),),)])
    assert seen[0][1] == (Partial("avg"),)
    assert not seen[1][1][0].is_partial("max")


def test_mean_even_uneven_nested():
    for shape, mesh, pl, want in [((8, 4), (4,), ((Shard(0),),), (Partial("avg"),)),
                                  ((3, 4), (4,), ((Shard(0),),), (Partial("sum"),)),
                                  ((3, 4), (2, 2), ((Shard(0), Replicate()),), (Partial("sum"), Replicate())),
                                  ((2, 4), (2, 2), ((Shard(0), Shard(0)),), (Partial("sum"), Partial("sum"))),
                                  ((4, 4), (2, 2), ((Shard(0), Shard(0)),), (Partial("avg"), Partial("avg"))),
                                  ((1, 4), (4,), ((Shard(0),),), (Partial("sum"),))]:
        x = data("any", shape, gen(("mean", shape)))
        seen = check(lambda t: t.mean(0), [x], mesh, combos=[pl])
        assert seen[0][1] == want, (shape, mesh, seen)
        seen = check(lambda t: t.mean(), [x], mesh, combos=[pl])
        assert not any(p.is_partial("avg") for p in seen[0][1]) or shape[0] % 4 == 0


def test_prod_empty_shard_and_partial_sum():
    x = data("coarse", (3, 5), gen("prod"))
    seen = check(lambda t: t.prod(0), [x], (4,), combos=[((Shard(0),),), ((Partial("sum"),),),
                                                         ((Partial("product"),),)], grad=False)
    assert [s[1] for s in seen][0] == (Partial("product"),)
    assert not seen[1][1][0].is_partial()
    assert seen[2][1] == (Partial("product"),)


def test_amax_of_partial_sum_and_empty_shards():
    x = data("distinct", (3, 5), gen("amax"))
    seen = check(lambda t: t.amax(0), [x], (4,), combos=[((Shard(0),),), ((Partial("sum"),),), ((Partial("max"),),),
                                                         ((Partial("min"),),)])
    assert seen[0][1] == (Partial("max"),) and seen[2][1] == (Partial("max"),)
    assert seen[1][1] != (Partial("sum"),)
    for f in (lambda t: t.max(), lambda t: t.min(), lambda t: t.amin(0), lambda t: t.amax((0, 1), keepdim=True)):
        check(f, [x], (4,), combos=[((Shard(0),),)])
        check(f, [x], (2, 2), combos=[((Shard(0), Shard(0)),), ((Shard(0), Shard(1)),)])
    # a reduce-scatter (cheaper than an all-reduce) is chosen for a P(sum) input
    y = data("distinct", (8, 8), gen("amax8"))

    def body(mesh):
        terms = {r: y / 4 for r in range(4)}
        d = DTensor.from_local(terms[mesh.get_coordinate()[0]], mesh, [Partial("sum")])
        with comm.CommLog(rank=mesh.get_rank()) as log:
            out = d.amax(0)
        return out.placements, sorted({e.kind for e in log.events}), out.full_tensor()

    pl, kinds, full = run((4,), body)
    assert kinds == ["reduce_scatter"], kinds
    torch.testing.assert_close(full, y.amax(0))


def test_max_out_is_elementwise():
    a, b = data("any", (7, 5), gen("mo_a")), data("any", (7, 5), gen("mo_b"))

    def body(mesh):
        da, db = distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(0)])
        o = distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0)])
        torch.max(da, db, out=o)
        return o.full_tensor(), o.placements

    full, pl = run((4,), body)
    torch.testing.assert_close(full, torch.maximum(a, b))
    assert pl == (Shard(0),)


def test_any_all_single_flag():
    x = torch.ones(7, 5, dtype=torch.bool)
    x[6, 4] = False
    y = torch.zeros(7, 5, dtype=torch.bool)
    y[6, 4] = True
    for mesh, pl in [((4,), (Shard(0),)), ((2, 2), (Shard(0), Shard(1))), ((2, 2), (Shard(1), Shard(0)))]:
        seen = check(lambda t: t.all(), [x], mesh, combos=[(pl,)], grad=False)
        assert all(p == Partial("min") for p in seen[0][1] if p.is_partial())
        check(lambda t: t.all(0), [x], mesh, combos=[(pl,)], grad=False)
        seen = check(lambda t: t.any(), [y], mesh, combos=[(pl,)], grad=False)
        assert all(p == Partial("max") for p in seen[0][1] if p.is_partial())
        check(lambda t: t.any(1), [y], mesh, combos=[(pl,)], grad=False)

    def body(mesh):
        d = distribute_tensor(x, mesh, [Shard(0)])
        return d.all().full_tensor().item(), d.all().to(torch.int64).full_tensor().item()

    assert run((4,), body) == (False, 0)


def _exact_indices(actual, expected, i):
    torch.testing.assert_close(actual, expected, equal_nan=True)


def test_argmax_ties_nan_keepdim():
    x = torch.zeros(7, 5)
    x[1, 0] = x[5, 0] = 3.0          # tie across a shard boundary (rows 1 and 5 on ranks 0 and 2)
    x[6, 1] = 9.0                    # maximum in the last (short) shard
    x[3, 2] = float("nan")           # NaN is the maximum
    x[2, 3] = x[4, 3] = -1.0
    x[:, 4] = 1.0                    # all equal -> first index
    combos = [((Shard(0),),), ((Shard(1),),), ((Partial("max"),),), ((Replicate(),),)]
    for f in (lambda t: t.argmax(0), lambda t: t.argmin(0), lambda t: t.argmax(0, keepdim=True),
              lambda t: t.argmin(0, keepdim=True), lambda t: t.argmax(), lambda t: t.argmax(keepdim=True)):
        check(f, [x], (4,), combos=combos, compare=_exact_indices, grad=False)
        check(f, [x], (2, 2), combos=[((Shard(0), Shard(0)),), ((Shard(0), Shard(1)),)], compare=_exact_indices,
              grad=False)


def test_max_dim_min_dim_through_decomposition():
    x = torch.zeros(7, 5)
    x[6, 0] = 5.0                    # max in the last shard of a 7-long dim
    x[1, 1] = x[4, 1] = 2.0          # tie across shards -> first index
    x[0, 2] = x[6, 2] = -3.0         # min tie, first and last shard
    x[3, 3] = float("nan")
    combos = [((Shard(0),),), ((Partial("sum"),),), ((Shard(1),),)]
    for f in (lambda t: t.max(0), lambda t: t.min(0), lambda t: t.max(0, keepdim=True), lambda t: t.min(-2)):
        seen = check(f, [x], (4,), combos=combos, compare=_exact_indices, grad=False)
        assert all(not p.is_partial() for s in seen for o in s[1] for p in o)
        check(f, [x], (2, 2), combos=[((Shard(0), Shard(1)),), ((Shard(0), Shard(0)),)], compare=_exact_indices,
              grad=False)
    y = data("distinct", (7, 5), gen("maxdim"))
    seen = check(lambda t: t.max(1), [y], (4,), combos=[((Shard(0),),)], grad=False)
    assert seen[0][1] == ((Shard(0),), (Shard(0),))


def test_var_std_placements_and_edge_cases():
    x = data("any", (7, 5), gen("var"))
    for corr in (0, 1):
        seen = check(lambda t: t.var(0, correction=corr), [x], (4,), combos=[((Shard(0),),), ((Shard(1),),)])
        assert seen[0][1] == (Partial("sum"),) and seen[1][1] == (Shard(0),)
        seen = check(lambda t: t.std(0, correction=corr), [x], (4,), combos=[((Shard(0),),)])
        assert seen[0][1] == (Replicate(),)
        seen = check(lambda t: t.var(correction=corr), [x], (2, 2), combos=[((Shard(0), Shard(1)),)])
        assert seen[0][1] == (Partial("sum"), Partial("sum"))
    y = data("any", (3, 5), gen("var3"))
    check(lambda t: t.var(0), [y], (4,), combos=[((Shard(0),),), ((Partial("sum"),),)])
    # N - correction <= 0: dense gives NaN (0/0) or inf; var then ends Replicate, not Partial(sum)
    for shape, corr in [((1, 5), 1), ((2, 5), 3), ((2, 5), 2), ((1, 5), 0)]:
        z = data("any", shape, gen(("var", shape)))
        seen = check(lambda t: (t.var(0, correction=corr), t.std(0, correction=corr), t.var(correction=corr)), [z],
                     (4,), combos=[((Shard(0),),), ((Shard(1),),)], grad=False)
        assert seen[0][1][0] == ((Replicate(),) if corr >= shape[0] else (Partial("sum"),))
        assert seen[0][1][1] == (Replicate(),)


def test_var_mean_both_outputs():
    x = data("any", (7, 6), gen("vm"))
    for keep in (False, True):
        seen = check(lambda t: torch.var_mean(t, 0, keepdim=keep), [x], (2, 2),
                     combos=[((Shard(0), Shard(1)),), ((Shard(0), Shard(0)),), ((Partial("avg"), Shard(0)),)])
        assert seen[0][1][0] == (Partial("sum"), Shard(1 if keep else 0))
        check(lambda t: torch.std_mean(t, 1, keepdim=keep), [x], (4,), combos=[((Shard(1),),), ((Shard(0),),)])


def test_scans_keep_other_shards():
    x = data("any", (7, 3), gen("scan"))
    seen = check(lambda t: t.cumsum(0), [x], (4,), combos=[((Shard(1),),), ((Partial("sum"),),), ((Partial("avg"),),),
                                                           ((Shard(0),),)], grad=False)
    assert seen[0][1] == (Shard(1),) and seen[1][1] == (Partial("sum"),) and seen[2][1] == (Partial("avg"),)
    assert not seen[3][1][0].is_shard(0)
    seen = check(lambda t: t.cumprod(0), [data("coarse", (7, 3), gen("cp"))], (4,), combos=[((Partial("sum"),),)],
                 grad=False)
    assert not seen[0][1][0].is_partial()
    y = data("distinct", (3, 7), gen("scan37"))
    for f in (lambda t: t.cumsum(1), lambda t: torch.cummax(t, 1), lambda t: torch.cummin(t, 1),
              lambda t: torch.logcumsumexp(t, 1), lambda t: t.cumprod(1)):
        seen = check(f, [y], (2, 2), combos=[((Shard(0), Shard(1)),), ((Shard(1), Shard(1)),)], grad=False)
        for o in (seen[0][1] if isinstance(seen[0][1][0], tuple) else (seen[0][1],)):
            assert o[0] == Shard(0)


GRAD_OK = {"sum", "mean", "amax", "amin", "var", "std", "nansum", "var_mean", "std_mean"}
"""OpInfo ops whose backward needs only rules that exist (prod/cumprod: a plain-tensor cat;
cumsum/logcumsumexp: flip; cummax/cummin/max.dim: scatter -- other families)."""


def test_opinfo_samples():
    pytest.importorskip("expecttest")
    from torch.testing._internal.common_methods_invocations import op_db

    names = {"sum", "mean", "prod", "amax", "amin", "argmax", "argmin", "var", "std", "cumsum", "cumprod",
             "logcumsumexp", "cummax", "cummin", "any", "all", "nansum", "var_mean", "std_mean"}
    ran = 0
    for info in op_db:
        if info.name not in names or info.variant_test_name:
            continue
        dtype = torch.bool if info.name in ("any", "all") else torch.float32
        taken = 0
        for sample in info.sample_inputs("cpu", dtype, requires_grad=False):
            t = sample.input
            if not isinstance(t, torch.Tensor) or t.ndim == 0 or t.numel() == 0 or taken >= 2:
                continue
            args, kwargs = sample.args, sample.kwargs
            if any(isinstance(a, torch.Tensor) for a in args) or "out" in kwargs:
                continue
            fn = (lambda op, a, k: lambda v: op(v, *a, **k))(info.op, args, kwargs)
            check(fn, [t.detach().clone()], (2, 2), combos=one_kind_combos([t], (2, 2), ("sum", "max"), limit=2,
                                                                        seed=info.name),
                  grad=info.name in GRAD_OK and dtype.is_floating_point, tol=dict(rtol=1e-4, atol=1e-4),
                  grad_tol=dict(rtol=1e-4, atol=1e-4))
            taken += 1
            ran += 1
    assert ran >= 25


def gloo_mean(t):
    return t.mean(0), t.amax(0), t.var(0), t.std(0)


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
def test_gloo_uneven_mean_amax_var():
    from distributed import gloo_available

    if not gloo_available():
        pytest.skip("gloo not available")
    x = data("any", (7, 5), gen("gloo"))
    seen = check(gloo_mean, [x], (4,), combos=[((Shard(0),),)], world="gloo", grad=False)
    assert seen[0][1] == ((Partial("sum"),), (Partial("max"),), (Partial("sum"),), (Replicate(),))


def test_non_default_shard_order():
    """Nested shards in a non-default order keep that order through the reduction."""
    x = data("distinct", (8, 7), gen("order"))
    fns = [lambda t: t.sum(1), lambda t: t.amax(1, keepdim=True), lambda t: t.var(1), lambda t: t.mean(1),
           lambda t: t.argmax(1), lambda t: t.cumsum(1), lambda t: torch.linalg.vector_norm(t, 3, 1)]

    def body(mesh, i):
        d = distribute_tensor(x, mesh, [Shard(0), Shard(0)]).redistribute(mesh, [Shard(0), Shard(0)],
                                                                             shard_order={0: [1, 0]})
        out = fns[i](d)
        return out.shard_order, out.to_local(), out.full_tensor(), mesh.get_coordinate()

    for i, f in enumerate(fns):
        res = run_spmd(lambda: body(init_device_mesh("cpu", (2, 2)), i), 4, timeout=60)
        want = f(x)
        for order, local, full, coord in res:
            assert order == ((0, (1, 0)),)
            torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-5)
            # mesh dim 1 splits first: rank (a, b) holds rows block 2b + a of four
            torch.testing.assert_close(local, want.chunk(4, 0)[2 * coord[1] + coord[0]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name,fn", [
    ("median0", lambda t: t.median(0)), ("median", lambda t: t.median()), ("nanmedian1", lambda t: t.nanmedian(1)),
    ("kthvalue", lambda t: t.kthvalue(3, 0, keepdim=True)), ("mode1", lambda t: t.mode(1)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_selecting_reductions(name, fn, mesh_shape):
    """median / nanmedian / kthvalue / mode: the dim gathered, other shards kept; values and indices."""
    x = data("coarse" if name.startswith("mode") else "distinct", (7, 5), gen(name))
    check(fn, [x], mesh_shape, limit=10, seed=name)
