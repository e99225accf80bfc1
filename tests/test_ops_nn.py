"""softmax, nll_loss / cross_entropy, layer_norm / rms_norm, topk / sort, dropout."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from opcheck import MESHES, check, data, gen, local_piece  # noqa: E402

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh, run_spmd  # noqa: E402
from shardtensor.propagation import RULES  # noqa: E402

aten = torch.ops.aten
R, S0, S1, S2, PS = Replicate(), Shard(0), Shard(1), Shard(2), Partial("sum")


def _kinds(mesh):
    """Partial kinds to try: opcheck builds one kind per tensor, so mixed kinds only on 1-D meshes."""
    return ("sum", "max") if len(mesh) == 1 else ("sum",)


def _targets(n_shape, classes, seed, ignore=None, where=None):
    t = torch.randint(0, classes, n_shape, generator=gen(seed))
    if where is not None:
        t[where] = ignore
    return t


def _dt(t, mesh, pl, grad=False):
    coord = mesh.get_coordinate()
    d = DTensor.from_local(local_piece(t, mesh.shape, coord, pl), mesh, list(pl), shape=t.shape, stride=t.stride())
    return d.requires_grad_() if grad else d


# -- 4. softmax ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("fn", [F.softmax, F.log_softmax], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,dim", [((7, 5), 1), ((3, 4, 2), 0), ((3, 4, 2), -1)])
def test_softmax(mesh, fn, shape, dim):
    x = data("any", shape, gen(("sm", shape)))
    seen = check(lambda a: fn(a, dim), [x], mesh, limit=8, partial=_kinds(mesh))
    d = dim % len(shape)
    for (pl,), out in seen:
        assert not any(p.is_partial() or p == Shard(d) for p in out)
        if not any(p.is_partial() or p == Shard(d) for p in pl):  # nothing moves: the input's shards
            assert out == pl


def test_softmax_of_a_partial_reduce_scatters_into_the_rows():
    """A Partial softmax input (a row-parallel projection's logits) is reduce-scattered into the
    rows, not all-reduced: half the bytes, and the loss after it keeps the rows (as DTensor)."""
    x = data("any", (8, 5), gen("smp"))

    def body():
        mesh = init_device_mesh("cpu", (4,))
        p = DTensor.from_local(x / 4, mesh, [Partial()])
        with comm.recording() as log:
            y = F.log_softmax(p, 1)
        return y.placements, [e.kind for e in log.of_rank(mesh.get_rank())], y.full_tensor()
    for pl, kinds, y in run_spmd(body, 4):
        assert pl == (S0,) and kinds == ["reduce_scatter"]
        torch.testing.assert_close(y, F.log_softmax(x, 1))


def test_softmax_keeps_other_shards_without_comm():
    def body():
        mesh = init_device_mesh("cpu", (4,))
        x = _dt(data("any", (7, 5), gen(1)), mesh, (S0,), grad=True)
        with comm.recording() as log:
            y = F.log_softmax(x, 1)
        return y.placements, len(log.of_rank(mesh.get_rank()))
    for pl, n in run_spmd(body, 4):
        assert pl == (S0,) and n == 0


def test_safe_softmax_fully_masked_row():
    x = data("any", (7, 5), gen(2))
    x[3] = float("-inf")
    x[5, :2] = float("-inf")
    for mesh in MESHES:
        seen = check(lambda a: aten._safe_softmax(a, 1), [x], mesh, limit=8, partial=())
        assert all(out[0] != S1 for _, out in seen)


@pytest.mark.parametrize("op", [aten._softmax_backward_data, aten._log_softmax_backward_data])
def test_softmax_backward_follows_more_sharded(op):
    g = data("any", (7, 6), gen(3))
    o = torch.softmax(data("any", (7, 6), gen(4)), 1)
    combos = [((S0, R), (R, R)), ((R, R), (S0, S0)), ((S0, S1), (R, S0)), ((PS, R), (S1, S0))]
    seen = check(lambda a, b: op(a, b, 1, torch.float32), [g, o], (2, 2), combos=combos, grad=False)
    assert [out for _, out in seen] == [(S0, R), (S0, S0), (S0, R), (R, S0)]


# -- 5. nll_loss / cross_entropy ----------------------------------------------------------------

def ce(x, t, w, reduction):
    return F.cross_entropy(x, t, weight=w.detach(), ignore_index=2, reduction=reduction)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("n", [7, 3])
def test_cross_entropy_2d(mesh, reduction, n):
    x = data("any", (n, 5), gen(("ce", n)))
    t = _targets((n,), 5, ("t", n))
    w = data("pos", (5,), gen(5))
    seen = check(lambda a, b, c: ce(a, b, c, reduction), [x, t, w], mesh, limit=10, seed=reduction)
    for (xp, tp, _), out in seen:
        if reduction == "mean" and any(isinstance(p, Shard) and p.dim == 0 for p in xp + tp):
            assert PS in out and all(p in (PS, R) for p in out)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_cross_entropy_4d(mesh, reduction):
    x = data("any", (2, 3, 7, 3), gen(6))
    t = _targets((2, 7, 3), 3, 7, ignore=2, where=(0, slice(0, 2)))
    seen = check(lambda a, b: F.cross_entropy(a, b, ignore_index=2, reduction=reduction), [x, t], mesh,
                 limit=8, seed=reduction)
    for (xp, tp), out in seen:
        if reduction == "none" and xp == (S2,) * len(mesh) and tp == (R,) * len(mesh):
            assert out == (S1,) * len(mesh)


def test_cross_entropy_no_weight_batch_sharded_both_mesh_dims():
    x = data("any", (7, 5), gen(8))
    t = _targets((7,), 5, 9)
    combos = [((S0, S0), (R, R)), ((R, S0), (S0, R)), ((S0, R), (R, R)), ((S1, PS), (R, S0))]
    seen = check(lambda a, b: F.cross_entropy(a, b), [x, t], (2, 2), combos=combos)
    # (R,S0)x(S0,R): the int target moves; (S1,P): softmax moves the class shard to the rows and
    # reduce-scatters the Partial into them too (cheaper than gathering and all-reducing)
    assert [out for _, out in seen] == [(PS, PS), (R, PS), (PS, R), (PS, PS)]


def test_nll_mean_all_targets_of_one_rank_ignored():
    x = torch.log_softmax(data("any", (8, 5), gen(10)), 1)
    w = data("pos", (5,), gen(11))
    t = _targets((8,), 5, 12, ignore=-1, where=slice(2, 4))
    fn = lambda a, b, c: F.nll_loss(a, b, weight=c.detach(), ignore_index=-1)  # noqa: E731
    combos = [((S0,), (S0,), (R,)), ((R,), (S0,), (R,)), ((S0,), (R,), (PS,))]
    seen = check(fn, [x, t, w], (4,), combos=combos)
    assert all(out == (PS,) for _, out in seen)
    t_all = torch.full((8,), -1)
    check(fn, [x, t_all, w], (4,), combos=combos)  # 0/0: NaN like dense


def test_nll_loss_1d_and_replicated_self_sharded_target():
    x = torch.log_softmax(data("any", (5,), gen(13)), 0)
    t = torch.tensor(3)
    for red in ("none", "sum", "mean"):
        seen = check(lambda a, b: F.nll_loss(a, b, reduction=red), [x, t], (4,), limit=6)
        assert all(out == ((PS,) if (xp, tp) == ((PS,), (R,)) else (R,)) for (xp, tp), out in seen)

    def body():
        mesh = init_device_mesh("cpu", (4,))
        xx = _dt(data("any", (7, 5), gen(14)), mesh, (R,))
        tt = _dt(_targets((7,), 5, 15), mesh, (S0,))
        with comm.recording() as log:
            out = aten.nll_loss_forward(xx, tt, None, 0, -100)
            mean = aten.nll_loss_forward(xx, tt, None, 1, -100)
        kinds = [e.kind for e in log.of_rank(mesh.get_rank())]
        return out[0].placements, mean[0].placements, mean[1].placements, kinds
    for o, m, tw, kinds in run_spmd(body, 4):
        assert (o, m, tw) == ((S0,), (PS,), (R,))
        assert kinds == ["all_reduce"]  # the total weight only; self is sliced, not gathered


def test_nll_partial_self_kept_for_linear_loss():
    x = data("any", (7, 5), gen(16))
    t = _targets((7,), 5, 17)
    for red in ("none", "sum", "mean"):
        seen = check(lambda a, b: F.nll_loss(a, b, reduction=red), [x, t], (4,), combos=[((PS,), (R,))])
        assert seen[0][1] == (PS,)


# -- 6. layer_norm / rms_norm -------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("shape,norm", [((7, 6), (6,)), ((3, 4, 5), (4, 5))])
def test_layer_norm(mesh, shape, norm):
    x = data("any", shape, gen(("ln", shape)))
    w = data("pos", norm, gen(18))
    b = data("any", norm, gen(19))
    axis = len(shape) - len(norm)
    seen = check(lambda a, c, d: F.layer_norm(a, norm, c, d), [x, w, b], mesh, limit=10,
                 grad_tol=dict(rtol=1e-4, atol=1e-4))
    for (xp, _, _), out in seen:
        assert out == tuple(p if isinstance(p, Shard) and p.dim < axis else R for p in xp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_layer_norm_statistics_keep_the_kernels_dtype(dtype):
    """CPU layer norm keeps half statistics half (its meta kernel says float32): every output
    reports the dtype its local data has, as on one device, with and without the decision cache."""
    x = data("any", (6, 5), gen(24)).to(dtype)
    dense = aten.native_layer_norm(x, [5], None, None, 1e-5)

    def body():
        mesh = init_device_mesh("cpu", (2,))
        dx = distribute_tensor(x, mesh, [S0])
        runs = [aten.native_layer_norm(dx, [5], None, None, 1e-5) for _ in range(2)]
        return [[(o.dtype, o._local_tensor.dtype, o.full_tensor()) for o in outs] for outs in runs]
    for runs in run_spmd(body, 2):
        for outs in runs:
            for (spec_dtype, local_dtype, got), want in zip(outs, dense):
                assert spec_dtype == local_dtype == want.dtype
                torch.testing.assert_close(got, want)


def test_wrapped_result_reports_its_local_dtype():
    """A rule's metadata comes from meta kernels; where a device's kernel makes another dtype, the
    DTensor reports the dtype of its data (the spec is retyped, once per spec and dtype)."""
    from shardtensor.dispatch.hit import wrap

    def body():
        mesh = init_device_mesh("cpu", (2,))
        spec = distribute_tensor(torch.zeros(4, 2), mesh, [S0])._spec
        local = torch.ones(2, 2, dtype=torch.bfloat16)
        a, b = wrap(local, spec), wrap((local, local), (spec, spec))
        return a.dtype, a._spec is b[1]._spec, a.full_tensor().dtype
    for dtype, shared, full in run_spmd(body, 2):
        assert dtype == full == torch.bfloat16 and shared


def test_layer_norm_backward_weight_grad_exact():
    x = data("any", (7, 6), gen(20))
    w, b = data("pos", (6,), gen(21)), data("any", (6,), gen(22))
    combos = [((S0, R), (R, R), (R, R)), ((R, S0), (R, R), (R, R)), ((S0, S0), (R, R), (R, R)),
              ((S0, S1), (R, R), (R, R)), ((PS, S0), (R, R), (R, R))]
    check(lambda a, c, d: F.layer_norm(a, (6,), c, d), [x, w, b], (2, 2), combos=combos,
          grad_tol=dict(rtol=1e-4, atol=1e-4))

    g = data("any", (7, 6), gen(23))
    out, mean, rstd = aten.native_layer_norm(x, [6], w, b, 1e-5)
    dense = aten.native_layer_norm_backward(g, x, [6], mean, rstd, w, b, [True, True, True])

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        a = (S0, R)
        args = [_dt(g, mesh, a), _dt(x, mesh, a), [6], _dt(mean, mesh, a), _dt(rstd, mesh, a),
                _dt(w, mesh, (R, R)), _dt(b, mesh, (R, R)), [True, True, True]]
        res = aten.native_layer_norm_backward(*args)
        part = aten.native_layer_norm_backward(*args[:-1], [True, False, True])
        return [(r.placements, r.full_tensor()) for r in res], part[1]
    for res, missing in run_spmd(body, 4):
        assert [p for p, _ in res] == [(S0, R), (PS, R), (PS, R)]
        for (_, got), want in zip(res, dense):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert missing is None


def test_fused_rms_norm_rule():
    """On CPU ``_fused_rms_norm`` is CompositeImplicitAutograd (never dispatched); call the
    pipeline directly for the forward and check the backward's decision."""
    from shardtensor.propagation import propagate
    from shardtensor.dispatch import dispatch
    from torch.utils._pytree import tree_flatten

    x = data("any", (7, 3, 4), gen(24))
    w = data("pos", (3, 4), gen(25))
    dense = aten._fused_rms_norm(x, [3, 4], w, 1e-6)

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        xx, ww = _dt(x, mesh, (S0, S2)), _dt(w / 2, mesh, (R, PS))
        out, rstd = dispatch(aten._fused_rms_norm.default, (xx, [3, 4], ww, 1e-6), {})
        gg = _dt(x, mesh, (S0, R))
        flat, tree = tree_flatten(((gg, xx, [3, 4], rstd, ww, [True, True]), {}))
        d = propagate(aten._fused_rms_norm_backward.default, flat,
                      [a._spec if isinstance(a, DTensor) else None for a in flat], tree)
        return out.placements, out.full_tensor(), rstd.full_tensor(), [s.placements for s in d.output]
    for pl, o, r, bwd in run_spmd(body, 4):
        assert pl == (S0, R)
        torch.testing.assert_close(o, dense[0])
        torch.testing.assert_close(r, dense[1])
        assert bwd == [(S0, R), (PS, R)]


@pytest.mark.skipif(aten.mean.dim not in RULES, reason="F.rms_norm on CPU decomposes into mean.dim (no rule yet)")
def test_rms_norm_composite():
    """CPU ``F.rms_norm`` arrives as pow / mean.dim / add_ / rsqrt / mul (pointwise + reduction rules).

    A sharded normalized dim is left out: ``mean.dim`` then gives a Partial that the in-place
    ``add_`` cannot turn into Replicate (pointwise rule raises).
    """
    x = data("any", (7, 6), gen(26))
    w = data("pos", (6,), gen(27))
    combos = [((R,), (R,)), ((S0,), (R,)), ((PS,), (R,)), ((S0,), (S0,))]
    check(lambda a, c: F.rms_norm(a, (6,), c), [x, w], (4,), combos=combos, tol=dict(rtol=1e-4, atol=1e-4))


# -- 7. topk / sort -----------------------------------------------------------------------------

_SCATTER = aten.scatter.src in RULES
"""The backward of topk/sort is ``new_zeros`` + ``scatter.src``: checked once that op has a rule."""

@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("dim,k,largest", [(1, 3, True), (0, 2, False)])
def test_topk(mesh, dim, k, largest):
    x = data("distinct", (7, 6), gen(("topk", dim)))
    seen = check(lambda a: torch.topk(a, k, dim, largest=largest), [x], mesh, limit=10, partial=_kinds(mesh),
                 grad=_SCATTER)
    for _, (vals, idx) in seen:
        assert vals == idx and Shard(dim) not in vals and not any(p.is_partial() for p in vals)


def test_topk_keeps_other_dim_shard_without_comm():
    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        x = _dt(data("distinct", (7, 6), gen(28)), mesh, (S0, S0))
        with comm.recording() as log:
            v, i = torch.topk(x, 2, 1)
        return v.placements, i.placements, len(log.of_rank(mesh.get_rank()))
    for v, i, n in run_spmd(body, 4):
        assert v == i == (S0, S0) and n == 0


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("dim,desc,stable", [(0, False, True), (1, True, False), (-1, False, False)])
def test_sort(mesh, dim, desc, stable):
    x = data("distinct", (7, 3, 4), gen(("sort", dim)))
    seen = check(lambda a: torch.sort(a, dim=dim, descending=desc, stable=stable), [x], mesh, limit=8,
                 grad=_SCATTER)
    d = dim % 3
    for (pl,), (vals, idx) in seen:
        assert vals == idx and Shard(d) not in vals
        if Shard(d) not in pl and not any(p.is_partial() for p in pl):
            assert vals == pl


# -- dropout ------------------------------------------------------------------------------------

def _dropout_run(x, mesh_shape, pl, p, train, fn, seed=1234, grad_w=None):
    torch.manual_seed(seed)

    def body():
        mesh = init_device_mesh("cpu", mesh_shape)
        a = _dt(x, mesh, pl, grad=True)
        y = fn(a, p, train)
        full = y.full_tensor()
        local_ok = torch.equal(y.to_local(), local_piece(full, mesh.shape, mesh.get_coordinate(), y.placements))
        g = None
        if grad_w is not None:
            (full * grad_w).sum().backward()
            g = a.grad.full_tensor()
        return full, y.placements, local_ok, g
    return run_spmd(body, math.prod(mesh_shape))


def native(a, p, train):
    return torch.native_dropout(a, p, train)[0]


def functional(a, p, train):
    return F.dropout(a, p, training=train)


@pytest.mark.parametrize("fn", [native, functional])
def test_dropout_same_mask_for_every_placement(fn):
    """One device's mask: dense torch after the same seed, for every placement and world size."""
    x = data("nonzero", (9, 7), gen(29))
    wgt = data("any", (9, 7), gen(30))
    p = 0.4
    torch.manual_seed(1234)
    dense = fn(x, p, True)
    ref = None
    for mesh_shape, pl in [((4,), (R,)), ((4,), (S0,)), ((4,), (S1,)), ((2, 2), (S1, S0)), ((2, 2), (R, S1)),
                           ((2, 2), (S0, S0))]:
        res = _dropout_run(x, mesh_shape, pl, p, True, fn, grad_w=wgt)
        full, out_pl, _, g = res[0]
        for r in res:
            assert torch.equal(r[0], full) and r[2], f"{pl}: ranks disagree or local shard mislabeled"
        assert out_pl == pl
        assert torch.equal(full, dense), f"{pl}: not one device's mask"
        if ref is None:
            ref = full
            keep = full != 0
            torch.testing.assert_close(full, torch.where(keep, x / (1 - p), torch.zeros_like(x)))
            torch.testing.assert_close(g, torch.where(keep, wgt / (1 - p), torch.zeros_like(x)))
        else:
            assert torch.equal(full, ref), f"{pl}: another mask than under Replicate"
    again = _dropout_run(x, (4,), (S0,), p, True, fn, seed=99)[0][0]
    assert not torch.equal(again, ref)


def test_dropout_rate_and_scale():
    x = torch.ones(64, 64)
    p = 0.3
    full, pl, _, _ = _dropout_run(x, (2, 2), (S0, S1), p, True, native)[0]
    kept = (full != 0).float().mean().item()
    assert abs(kept - (1 - p)) < 4 * (p * (1 - p) / x.numel()) ** 0.5
    assert torch.allclose(full[full != 0], torch.full_like(full[full != 0], 1 / (1 - p)))
    assert abs(full.mean().item() - 1.0) < 0.05


def test_dropout_consecutive_calls_differ_and_eval_is_identity():
    torch.manual_seed(0)

    def body():
        mesh = init_device_mesh("cpu", (4,))
        a = _dt(torch.ones(8, 8), mesh, (S0,))
        m1 = torch.native_dropout(a, 0.5, True)[1].full_tensor()
        m2 = torch.native_dropout(a, 0.5, True)[1].full_tensor()
        pp = _dt(torch.ones(8, 8) * (mesh.get_rank() + 1), mesh, (PS,))
        ev, evm = torch.native_dropout(pp, 0.5, False)
        tr = torch.native_dropout(pp, 0.5, True)[0]
        return (not torch.equal(m1, m2), ev.placements, evm.placements, ev.full_tensor(), tr.placements,
                F.dropout(a, 0.5, training=False) is a)
    for differ, evp, evmp, ev, trp, same in run_spmd(body, 4):
        assert differ and same
        assert evp == (PS,) and evmp == (R,) and torch.equal(ev, torch.full((8, 8), 10.0))
        assert trp == (R,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dropout_and_bernoulli_equal_one_device_on_uneven_shards(dtype):
    """F.dropout, bernoulli_(p) and bernoulli(probs) of every dtype, on 1-D and 2-D meshes with
    uneven and empty shards (3 rows over 4 ranks): one device's values, and the next plain draw
    agrees with one device's too (every rank's generator advanced alike)."""
    x = torch.randn(3, 5, generator=gen(36)).to(dtype)
    probs = torch.rand(3, 5, generator=gen(37)).to(dtype)

    def calls(a, q):
        return F.dropout(a, 0.3), torch.empty_like(a).bernoulli_(0.6), torch.bernoulli(q)

    torch.manual_seed(3)
    want = [*calls(x, probs), torch.rand(2)]
    for mesh_shape, pl in [((4,), (S0,)), ((4,), (S1,)), ((2, 2), (S0, S1)), ((2, 2), (R, S0))]:
        torch.manual_seed(3)

        def body():
            mesh = init_device_mesh("cpu", mesh_shape)
            outs = calls(_dt(x, mesh, pl), _dt(probs, mesh, pl))
            return [o.full_tensor() for o in outs] + [torch.rand(2)]
        for got in run_spmd(body, 4):
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and torch.equal(g, w), f"{mesh_shape} {pl}"


def test_dropout_partial_input_reduced_first():
    x = data("nonzero", (6, 5), gen(31))
    torch.manual_seed(5)

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        a = DTensor.from_local(x / 2, mesh, [PS, R], shape=x.shape)
        y = F.dropout(a, 0.5)
        return y.full_tensor(), y.placements
    res = run_spmd(body, 4)
    full = res[0][0]
    keep = full != 0
    torch.testing.assert_close(full, torch.where(keep, x * 2, torch.zeros_like(x)))
    assert all(torch.equal(r[0], full) for r in res)


def test_bernoulli_same_draw_for_every_placement():
    probs = torch.rand(9, 6, generator=gen(35))
    probs[0] = 0.0
    probs[1] = 1.0
    outs = []
    for mesh_shape, pl in [((4,), (R,)), ((4,), (S0,)), ((2, 2), (S1, S0))]:
        torch.manual_seed(7)

        def body():
            mesh = init_device_mesh("cpu", mesh_shape)
            a = _dt(probs, mesh, pl)
            return torch.bernoulli(a).full_tensor(), a.bernoulli(0.5).full_tensor()
        res = run_spmd(body, 4)
        assert all(torch.equal(r[0], res[0][0]) and torch.equal(r[1], res[0][1]) for r in res)
        outs.append(res[0])
    torch.manual_seed(7)
    dense = torch.bernoulli(probs), probs.bernoulli(0.5)
    for b, h in outs:
        assert torch.equal(b, dense[0]) and torch.equal(h, dense[1]), "not one device's draw"
        assert torch.equal(b[0], torch.zeros(6)) and torch.equal(b[1], torch.ones(6))
        assert set(h.unique().tolist()) <= {0.0, 1.0}


def test_non_default_shard_order_is_respected():
    x = data("any", (9, 6), gen(36))

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        a = _dt(x, mesh, (R, R)).redistribute(mesh, [S0, S0], shard_order={0: [1, 0]})
        outs = [F.layer_norm(a, (6,)), F.log_softmax(a, 1), torch.topk(a, 2, 1)[0]]
        return [o.full_tensor() for o in outs]
    want = [F.layer_norm(x, (6,)), F.log_softmax(x, 1), torch.topk(x, 2, 1)[0]]
    for got in run_spmd(body, 4):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


# -- gloo ---------------------------------------------------------------------------------------

def gloo_body(rank, world, x, t, w):
    """Real processes: weighted mean cross_entropy fwd+bwd on S(0) logits, and dropout masks
    that agree across ranks although every rank's generator is seeded differently."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    a = _dt(x, mesh, (S0,), grad=True)
    loss = F.cross_entropy(a, _dt(t, mesh, (S0,)), weight=_dt(w, mesh, (R,)), ignore_index=1)
    loss.full_tensor().backward()
    drops = []
    for pl in [(R,), (S0,)]:
        torch.manual_seed(100 + rank)
        drops.append(F.dropout(_dt(torch.ones(9, 4), mesh, pl), 0.5).full_tensor())
    return loss.placements, loss.full_tensor(), a.grad.full_tensor(), drops


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
def test_gloo_cross_entropy_backward_and_dropout():
    from distributed import gloo_available, run_multiprocess
    if not gloo_available():
        pytest.skip("gloo unavailable")
    x = data("any", (7, 5), gen(32))
    t = _targets((7,), 5, 33, ignore=1, where=slice(4, 6))
    w = data("pos", (5,), gen(34))
    xd = x.clone().requires_grad_()
    dense = F.cross_entropy(xd, t, weight=w, ignore_index=1)
    dense.backward()
    res = run_multiprocess(gloo_body, 4, timeout=180, args=(x, t, w))
    for pl, loss, grad, drops in res:
        assert pl == (PS,)
        torch.testing.assert_close(loss, dense.detach())
        torch.testing.assert_close(grad, xd.grad)
        assert torch.equal(drops[0], drops[1]) and torch.equal(drops[0], res[0][3][0])


# -- scaled dot-product attention ---------------------------------------------------------------

@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_sharded_heads_and_batch(causal, mesh_shape):
    """Forward and backward with batch or heads sharded (uneven: 3 batches, 5 heads), Partial inputs reduced."""
    g = gen(("sdpa", causal))
    q, k, v = (data("any", (3, 5, 6, 4), g) for _ in range(3))
    seen = check(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), [q, k, v], mesh_shape,
                 limit=12, seed=("sdpa", causal), tol=dict(rtol=1e-4, atol=1e-5))
    heads = ((Replicate(), Shard(1)) if len(mesh_shape) == 2 else (Shard(1),))
    same = [out for (a, b, c), out in seen if a == b == c == heads]
    assert all(out == heads for out in same), same


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_sdpa_with_mask(mesh_shape):
    g = gen("sdpa-mask")
    q, k, v = (data("any", (2, 4, 5, 3), g) for _ in range(3))
    mask = torch.rand(5, 5, generator=g) > 0.3
    mask[:, 0] = True  # no fully masked row
    check(lambda a, b, c, m: F.scaled_dot_product_attention(a, b, c, attn_mask=m), [q, k, v, mask], mesh_shape,
          limit=10, seed="sdpa-mask", tol=dict(rtol=1e-4, atol=1e-5))



@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("mask", ["causal", "3-D mask"])
def test_sdpa_on_3d_inputs(mesh_shape, mask):
    """(batch, seq, dim) attention: torch's math path would build a plain causal mask; it runs as
    4-D with a batch of one instead, so the batch dim keeps its shards."""
    g = gen(("sdpa-3d", mask))
    q, k, v = (data("any", (5, 6, 4), g) for _ in range(3))
    if mask == "causal":
        fn, values = (lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)), [q, k, v]
    else:
        m = torch.rand(5, 6, 6, generator=g) > 0.3
        m[..., 0] = True
        fn, values = (lambda a, b, c, d: F.scaled_dot_product_attention(a, b, c, attn_mask=d)), [q, k, v, m]
    batch = tuple(Shard(0) if i == 0 else Replicate() for i in range(len(mesh_shape)))
    rep = (Replicate(),) * len(mesh_shape)
    part = (Partial(),) + rep[1:]
    combos = [(batch,) * 3 + (rep,) * (len(values) - 3), (rep,) * len(values), (part, rep, batch) + (batch,) * (len(values) - 3)]
    seen = check(fn, values, mesh_shape, combos=combos, tol=dict(rtol=1e-4, atol=1e-5))
    assert seen[0][1] == batch, seen[0]


BATCH_NORM_INTERNALS = {
    "_native_batch_norm_legit": lambda x, w, b, rm, rv: aten._native_batch_norm_legit(x, w, b, rm, rv, True, 0.1, 1e-5),
    "_batch_norm_with_update": lambda x, w, b, rm, rv: aten._batch_norm_with_update(x, w, b, rm, rv, 0.1, 1e-5),
}


@pytest.mark.parametrize("name", sorted(BATCH_NORM_INTERNALS))
def test_batch_norm_internal_ops_update_running_stats_and_differentiate(name):
    """The forms torch.compile, export and functionalization use for BatchNorm training: they write
    the running stats (buffers their own backward saved) and return the normalized input."""
    op = BATCH_NORM_INTERNALS[name]

    def fn(x, w, b, rm, rv):
        rm, rv = rm.detach().clone(), rv.detach().clone()  # buffers: no grad, written by the op
        out = op(x, w, b, rm, rv)
        return out[0], rm, rv

    g = gen(name)
    values = [data("any", (6, 3, 5), g), data("pos", (3,), g), data("any", (3,), g), data("any", (3,), g),
              data("pos", (3,), g)]
    for mesh in MESHES:
        check(fn, values, mesh, limit=10, tol=dict(rtol=1e-4, atol=1e-4))


def test_ops_that_crashed_where_one_device_runs():
    """fractional max pooling (the caller's random samples), quantile (a scalar q broadcast by
    torch's C++) and rrelu (no rule) on every layout, against one device."""
    g = gen("crashed")
    x4 = data("distinct", (2, 3, 8, 8), g)
    samples = torch.rand(2, 3, 2, generator=g)
    check(lambda a: F.fractional_max_pool2d(a, 2, output_size=(4, 4), _random_samples=samples), [x4], (4,), limit=8)
    x = data("any", (5, 7), g)
    check(lambda a: torch.quantile(a, 0.3, dim=1), [x], (4,), limit=8)
    check(lambda a: F.rrelu(a, training=False), [x], (2, 2), limit=8)


def test_chunked_linear_cross_entropy_backward():
    """Chunked linear_cross_entropy's backward writes a 0-d plain accumulator in place (torch 2.13+)."""
    options = pytest.importorskip("torch.nn.modules.linear_cross_entropy_options")
    LinearCrossEntropyOptions = options.LinearCrossEntropyOptions
    g = gen("crashed-lce")
    x = data("any", (5, 7), g)
    w, t = data("any", (6, 7), g), torch.randint(0, 6, (5,), generator=g)
    opts = LinearCrossEntropyOptions(batch_chunk_size=2)
    for red in ("mean", "sum", "none"):
        check(lambda a, b, c: F.linear_cross_entropy(a, b, c, reduction=red, options=opts), [x, w, t], (4,), limit=8,
              tol=dict(rtol=1e-4, atol=1e-4))


def test_rrelu_training_draws_valid_slopes_alike_on_replicas():
    """Training rrelu: negative elements scaled by a slope in [lower, upper], others kept; the
    gradient is that slope; replicas agree."""
    x = data("nonzero", (6, 5), gen("rrelu"))

    def body(pl):
        mesh = init_device_mesh("cpu", (2, 2))
        d = distribute_tensor(x, mesh, pl).requires_grad_()
        y = F.rrelu(d, 0.1, 0.3, training=True)
        y.sum().backward()
        return y.full_tensor(), d.grad.full_tensor()

    for pl in ([Replicate(), Replicate()], [Shard(0), Shard(1)], [Shard(1), Replicate()]):
        outs = run_spmd(body, 4, pl)
        y, grad = outs[0]
        assert all(torch.equal(o[0], y) and torch.equal(o[1], grad) for o in outs)
        slope = y / x
        assert torch.equal(y[x > 0], x[x > 0]) and bool(((slope[x < 0] >= 0.1 - 1e-6) & (slope[x < 0] <= 0.3 + 1e-6)).all())
        torch.testing.assert_close(grad, slope)


# -- grid sampling ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,align", [("bilinear", False), ("nearest", True), ("bicubic", False)])
@pytest.mark.parametrize("mesh", MESHES)
def test_grid_sample(mode, align, mesh):
    """Batch, channels and output points shard with no gather of the other operand; a Partial
    input stays Partial (the sampler is linear in it); forward and backward against one device."""
    x = data("any", (2, 3, 5, 6), gen(("gs", 1)))
    grid = data("any", (2, 4, 7, 2), gen(("gs", 2))) * 0.9
    seen = check(lambda a, b: F.grid_sample(a, b, mode=mode, align_corners=align), [x, grid], mesh, limit=10,
                 seed=("gs", mode))
    for (in_pl, grid_pl), out_pl in seen:
        if in_pl == tuple(Shard(1) for _ in in_pl) and all(p == Replicate() for p in grid_pl):
            assert out_pl[0] == Shard(1)  # channels stay sharded: the grid is not moved


def test_grid_sample_3d():
    x = data("any", (2, 3, 4, 5, 3), gen(("gs3", 1)))
    grid = data("any", (2, 3, 2, 4, 3), gen(("gs3", 2))) * 0.9
    check(lambda a, b: F.grid_sample(a, b, align_corners=True), [x, grid], (2, 2), limit=8, seed="gs3")
