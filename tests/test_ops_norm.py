"""Vector norms and _foreach_norm.

Differential checks against dense torch on meshes (4,) and (2, 2), lengths 8, 7 and 3 on the
sharded dims (3 over 4 ranks leaves an empty shard, where torch raises for inf and negative
ords), Partial inputs that must be reduced first, NormPartial inputs that may stay, the
R -> PN(p) -> R round trip, and the gradient-clipping pattern.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from opcheck import MESHES, check, data, gen, placement_combos  # noqa: E402

from shardtensor import (DTensor, Partial, Replicate, Shard, comm, distribute_tensor,  # noqa: E402
                         init_device_mesh, run_spmd)
from shardtensor.placement import NormPartial  # noqa: E402
from shardtensor.redistribute import redistribute_local  # noqa: E402

aten = torch.ops.aten
INF = math.inf
CASES = [((8, 6), (4,)), ((7, 5), (4,)), ((7, 5), (2, 2)), ((3, 5), (4,)), ((3, 5), (2, 2))]
"""Lengths 8, 7 (2,2,2,1 on four ranks) and 3 (1,1,1,0: an empty shard) on both meshes."""
TOL = dict(rtol=1e-4, atol=1e-4)


def one_kind_combos(tensors, mesh, kinds, limit, seed) -> list:
    """Random placement combos with at most one Partial kind per tensor (all-R always kept)."""
    every = placement_combos(tensors, mesh, None, seed, kinds)
    ok = [c for c in every if all(len({p.reduce_op for p in pl if isinstance(p, Partial)}) <= 1 for pl in c)]
    picked = random.Random(repr((seed, mesh))).sample(ok, min(limit, len(ok)))
    allr = tuple(tuple(Replicate() for _ in mesh) for _ in tensors)
    if allr not in picked:
        picked[-1] = allr
    return picked


def run(mesh_shape, body, *args):
    """``body(mesh, *args)`` on every simulated rank; rank 0's result."""
    return run_spmd(lambda: body(init_device_mesh("cpu", mesh_shape), *args), math.prod(mesh_shape), timeout=60)[0]


def move(d: DTensor, placements) -> DTensor:
    """Redistribute through the executor itself (public ``redistribute`` refuses ``R -> PN``)."""
    spec = d._spec.with_placements(placements)
    return DTensor(redistribute_local(d._local_tensor, d._spec, spec), spec)


def norms(ords, dim=None, keepdim=False):
    return lambda t: tuple(torch.linalg.vector_norm(t, o, dim, keepdim) for o in ords)


GROUPS = {
    "finite_positive": lambda t: (*norms((2, 1, 3, 0.5))(t), *norms((2, 1, 3, 0.5), 0)(t),
                                  *norms((2, 1, 0.5), 1, True)(t)),
    "inf_zero_negative": lambda t: (*norms((INF, -INF, 0, -1))(t), *norms((INF, -INF, 0, -1), 0)(t),
                                    *norms((INF, -INF, -1), (0, 1), True)(t)),
}


@pytest.mark.parametrize("shape,mesh", CASES)
@pytest.mark.parametrize("name", list(GROUPS))
def test_vector_norm(name, shape, mesh):
    x = data("nonzero", shape, gen((name, shape)))
    combos = one_kind_combos([x], mesh, ("sum", "max", "min"), 4, name)
    seen = check(GROUPS[name], [x], mesh, combos=combos, tol=TOL, grad_tol=TOL)
    for pls, outs in seen:
        for out in outs:
            assert not any(type(p) is Partial for p in out), (pls, outs)


def test_shard_gives_norm_partial_without_comm():
    x = data("nonzero", (7, 5), gen("pn"))
    for o in (2, 1, 0, INF, -INF, 3, 0.5, -1):
        def body(mesh):
            d = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
            with comm.CommLog(rank=mesh.get_rank()) as log:
                out = torch.linalg.vector_norm(d, o)
                row = torch.linalg.vector_norm(d, o, 1)
            return out.placements, row.placements, len(log.events), out.full_tensor(), row.full_tensor()

        pl, row_pl, n, full, row = run((2, 2), body)
        assert pl == (NormPartial(o), NormPartial(o)) and row_pl == (Shard(0), NormPartial(o)) and n == 0
        torch.testing.assert_close(full, torch.linalg.vector_norm(x, o), **TOL)
        torch.testing.assert_close(row, torch.linalg.vector_norm(x, o, 1), **TOL)


def test_partial_sum_input_is_reduced_first():
    x = data("nonzero", (8, 6), gen("psum"))
    seen = check(lambda t: torch.linalg.vector_norm(t, 2, 0), [x], (4,), combos=[((Partial("sum"),),),
                                                                               ((Partial("max"),),)], tol=TOL)
    assert all(not o[0].is_partial() or o[0] == NormPartial(2) for _, o in seen)


def test_norm_partial_inputs():
    v = data("pos", (7, 5), gen("pn_in"))

    def body(mesh, p, q):
        d = move(distribute_tensor(v, mesh, [Replicate()]), [NormPartial(p)])
        out = torch.linalg.vector_norm(d, q, 0)
        return out.placements, out.full_tensor()

    for p in (2, 1, INF, -INF, 3, 0.5, -1):
        pl, full = run((4,), body, p, p)
        assert pl == (NormPartial(p),), (p, pl)
        torch.testing.assert_close(full, torch.linalg.vector_norm(v, p, 0), **TOL)
        pl, full = run((4,), body, p, 2 if p != 2 else 1)
        assert pl != (NormPartial(p),)
        torch.testing.assert_close(full, torch.linalg.vector_norm(v, 2 if p != 2 else 1, 0), **TOL)


def test_round_trip_and_norm0_refused():
    v = data("pos", (7, 5), gen("rt"))

    def body(mesh, p, dtype):
        d = distribute_tensor(v.to(dtype) * (300 if dtype == torch.float16 else 1), mesh, [Replicate(), Shard(1)])
        pn = move(d, [NormPartial(p), Shard(1)])
        return move(pn, [Replicate(), Shard(1)]).full_tensor(), pn.full_tensor()

    for p in (2, 1, INF, -INF, 3, 0.5, -1):
        for dtype in (torch.float32, torch.float16):
            want = v.to(dtype) * (300 if dtype == torch.float16 else 1)
            back, full = run((2, 2), body, p, dtype)
            assert torch.isfinite(back).all()
            torch.testing.assert_close(back, want, rtol=2e-3, atol=1e-3)
            torch.testing.assert_close(full, want, rtol=2e-3, atol=1e-3)
    with pytest.raises(RuntimeError, match="NormPartial"):
        run((2, 2), body, 0, torch.float32)


def test_dtype_kwarg_and_norm_overloads():
    x = data("nonzero", (7, 5), gen("dtype"))
    combos = [((Shard(0),),), ((Shard(1),),), ((Partial("sum"),),)]
    seen = check(lambda t: torch.linalg.vector_norm(t, 2, 0, dtype=torch.float64), [x], (4,), combos=combos, tol=TOL)
    assert seen[0][1] == (NormPartial(2),)
    check(lambda t: (aten.norm.Scalar(t, 3), aten.norm.ScalarOpt_dim(t, None, [0], True),
                     aten.norm.ScalarOpt_dim_dtype(t, INF, [1], False, dtype=torch.float64),
                     aten.norm.ScalarOpt_dtype(t, 1, dtype=torch.float64), torch.norm(t), t.norm(p=1, dim=1)),
          [x], (4,), combos=combos + [((Replicate(),),)], tol=TOL, grad_tol=TOL)
    with pytest.raises(RuntimeError, match="non-complex"):  # no rule: it runs whole, and torch refuses as on one device
        run((4,), lambda mesh: torch.linalg.vector_norm(distribute_tensor(x, mesh, [Shard(0)]), complex(1, 1)))


def test_inf_norm_negative_entries_and_empty_shards():
    x = -data("pos", (3, 5), gen("neg"))
    x[2, 3] = -9.0
    for o in (INF, -INF, -1):
        seen = check(lambda t: (torch.linalg.vector_norm(t, o), torch.linalg.vector_norm(t, o, 0)), [x], (4,),
                     combos=[((Shard(0),),)], tol=TOL, grad_tol=TOL)
        assert seen[0][1] == ((NormPartial(o),), (NormPartial(o),))


def foreach_norms(ord):
    return lambda ts: tuple(torch._foreach_norm(ts, ord))


def clip_total(ord):
    return lambda ts: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ts, ord)), ord)


@pytest.mark.parametrize("mesh", MESHES)
def test_foreach_norm_and_clip_grad_pattern(mesh):
    ts = [data("nonzero", (7, 5), gen("fa")), data("nonzero", (3, 5), gen("fb")), data("nonzero", (8,), gen("fc"))]
    r = tuple(Replicate() for _ in mesh)
    s0 = (Shard(0),) + r[1:]
    mixed = (s0, (Shard(1),) + r[1:], r)
    for o in (2, 1, INF, -INF, 0.5):
        seen = check(foreach_norms(o), [ts], mesh, combos=[mixed, (s0, s0, s0)], tol=TOL, grad_tol=TOL)
        pn = (NormPartial(o),) + r[1:]
        assert seen[0][1] == (pn, pn, r)
        assert seen[1][1] == (pn, pn, pn)
        seen = check(clip_total(o), [ts], mesh, combos=[mixed, (s0, s0, s0)], tol=TOL, grad_tol=TOL)
        assert seen[1][1] == pn


def test_foreach_norm_one_collective_for_total():
    ts = [data("nonzero", (7, 5), gen(("c", i))) for i in range(3)]

    def body(mesh):
        ds = [distribute_tensor(t, mesh, [Shard(0)]) for t in ts]
        with comm.CommLog(rank=mesh.get_rank()) as log:
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(ds, 2)), 2)
            value = total.full_tensor()
        return total.placements, [e.kind for e in log.events], value

    pl, kinds, value = run((4,), body)
    assert pl == (NormPartial(2),) and kinds == ["all_reduce"]
    torch.testing.assert_close(value, torch.linalg.vector_norm(torch.stack([t.norm() for t in ts])), **TOL)


def gloo_norms(t):
    return torch.linalg.vector_norm(t, 2), torch.linalg.vector_norm(t, INF, 0), torch.linalg.vector_norm(t, -1, 1)


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
def test_gloo_norms():
    from distributed import gloo_available

    if not gloo_available():
        pytest.skip("gloo not available")
    x = data("nonzero", (3, 5), gen("gloo"))
    seen = check(gloo_norms, [x], (4,), combos=[((Shard(0),),)], world="gloo", grad=False, tol=TOL)
    assert seen[0][1] == ((NormPartial(2),), (NormPartial(INF),), (Shard(0),))
