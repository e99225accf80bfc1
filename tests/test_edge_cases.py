"""Regression tests for silent wrong results, hangs and crashes found by edge-case sweeps.

Each family is checked differentially against dense single-device torch: Partial values of
bool, int8 and complex dtypes (simulated world and gloo), reductions over empty shards, casts
of Partial values, broadcast biases of addmv/addmm with empty shards, and nll_loss backward on
non-contiguous local shards.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from opcheck import MESHES, check, data, gen

from shardtensor import (DTensor, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh,  # noqa: E402
                         run_spmd)

# -- Partial values of odd dtypes --------------------------------------------------------------

_COMBINE = {
    "sum": lambda a, b: a | b if a.dtype == torch.bool else a + b,
    "max": lambda a, b: torch.maximum(a, b),
    "min": lambda a, b: torch.minimum(a, b),
    "product": lambda a, b: a & b if a.dtype == torch.bool else a * b,
}


def _terms(dtype: torch.dtype, n: int) -> list[torch.Tensor]:
    g = gen(("terms", str(dtype)))
    if dtype == torch.bool:
        return [torch.rand(5, generator=g) > 0.6 for _ in range(n)]
    if dtype == torch.int8:  # large enough that an int8 sum wraps, as torch's int8 addition does
        return [torch.randint(-128, 128, (5,), generator=g, dtype=torch.int8) for _ in range(n)]
    return [torch.complex(torch.randn(5, generator=g), torch.randn(5, generator=g)).to(dtype) for _ in range(n)]


def _expected(terms: list[torch.Tensor], kind: str) -> torch.Tensor:
    if kind == "avg":
        return functools.reduce(torch.add, terms) / len(terms)
    return functools.reduce(_COMBINE[kind], terms)


_CASES = [(torch.bool, k) for k in ("sum", "max", "min", "product")] + \
         [(torch.int8, k) for k in ("sum", "max", "min", "product")] + \
         [(torch.complex64, k) for k in ("sum", "avg", "product")]


def _partial_full(mesh_shape, terms, kind):
    mesh = init_device_mesh("cpu", mesh_shape)
    d = DTensor.from_local(terms[mesh.get_rank()].clone(), mesh, [Partial(kind)] * len(mesh_shape))
    return d.dtype, d.full_tensor(), d.redistribute(mesh, [Shard(0)] + [Replicate()] * (len(mesh_shape) - 1)).full_tensor()


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("dtype,kind", _CASES, ids=str)
def test_partial_keeps_dtype_and_value(dtype, kind, mesh_shape):
    """All-reduce and reduce-scatter of a Partial keep its dtype (bool sums are or, ints wrap)."""
    terms = _terms(dtype, 4)
    want = _expected(terms, kind)
    for dt, full, via_shard in run_spmd(_partial_full, 4, mesh_shape, terms, kind):
        assert dt == dtype
        for got in (full, via_shard):
            assert got.dtype == dtype, (got.dtype, dtype)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _gloo_partial(rank, world, cases):
    return [_partial_full((4,), terms, kind) for terms, kind in cases]


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
def test_partial_keeps_dtype_and_value_gloo():
    from distributed import gloo_available, run_multiprocess
    if not gloo_available():
        pytest.skip("gloo unavailable")
    cases = [(_terms(dtype, 4), kind) for dtype, kind in _CASES if not (dtype == torch.complex64 and kind != "sum")]
    res = run_multiprocess(_gloo_partial, 4, timeout=120, args=(cases,))
    for per_rank in res:
        for (terms, kind), (dt, full, via_shard) in zip(cases, per_rank):
            want = _expected(terms, kind)
            for got in (full, via_shard):
                assert got.dtype == want.dtype, (kind, got.dtype)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# -- casts of Partial values -------------------------------------------------------------------

def _cast_partial(mesh_shape, terms, kind, dtype):
    mesh = init_device_mesh("cpu", mesh_shape)
    d = DTensor.from_local(terms[mesh.get_rank()].clone(), mesh, [Partial(kind)] * len(mesh_shape))
    out = d.to(dtype)
    return out.placements, out.full_tensor()


# per-rank float32 terms whose bfloat16 roundings do not add up to the rounded sum
_ROUNDING_TERMS = [1.5409960746765137, -0.293428897857666, -2.1787893772125244, 0.5684312582015991]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("kind,dtype,stays", [
    ("sum", torch.bfloat16, False), ("sum", torch.float16, False), ("avg", torch.bfloat16, False),
    ("sum", torch.int32, False), ("sum", torch.bool, False), ("sum", torch.float64, True),
    ("sum", torch.complex64, True), ("max", torch.bfloat16, True), ("min", torch.float16, True),
    ("max", torch.int32, False), ("product", torch.bfloat16, False),
], ids=str)
def test_cast_of_partial(kind, dtype, stays, mesh_shape):
    """A rounding cast reduces the Partial first; a widening one (or max/min between floats) keeps it."""
    terms = [torch.tensor([t, t / 3, 2.0 * t]) for t in _ROUNDING_TERMS]
    assert terms[0].bfloat16().float().sum() != terms[0].sum()  # the data can tell the two apart
    value = _expected(terms, kind)
    want = value.to(dtype)
    if dtype == torch.bfloat16 and kind == "sum":
        assert not torch.equal(functools.reduce(torch.add, [t.to(dtype) for t in terms]), want)
    for pl, full in run_spmd(_cast_partial, 4, mesh_shape, terms, kind, dtype):
        assert all(isinstance(p, Partial) for p in pl) == stays, pl
        assert full.dtype == dtype
        torch.testing.assert_close(full, want, rtol=1e-6, atol=1e-6)


# -- reductions over empty shards and empty tensors ---------------------------------------------

_REDUCTIONS = {
    "sum": lambda t: t.sum(), "sum0": lambda t: t.sum(0), "mean1": lambda t: t.mean(1),
    "prod": lambda t: t.prod(), "amax0": lambda t: t.amax(0), "amin1": lambda t: t.amin(1),
    "max": lambda t: t.max(), "min": lambda t: t.min(), "max0": lambda t: t.max(0), "min1": lambda t: t.min(1),
    "argmax": lambda t: t.argmax(), "argmin0": lambda t: t.argmin(0), "any": lambda t: (t > 0).any(),
    "all1": lambda t: (t > 0).all(1), "norm": lambda t: t.norm(), "var0": lambda t: t.var(0),
    "logsumexp1": lambda t: t.logsumexp(1), "cumsum0": lambda t: t.cumsum(0), "median": lambda t: t.median(),
    "median1": lambda t: t.median(1), "kthvalue0": lambda t: t.kthvalue(1, 0), "mode1": lambda t: t.mode(1),
}


def _outcome(fn, t):
    try:
        out = fn(t)
    except (RuntimeError, IndexError, ValueError) as e:
        return ("raises", type(e).__name__ if not isinstance(e, RuntimeError) else "RuntimeError")
    outs = out if isinstance(out, tuple) else (out,)
    return ("ok", [o.full_tensor() if isinstance(o, DTensor) else o for o in outs])


def _empty_body(mesh_shape, base, placements):
    x = distribute_tensor(base, init_device_mesh("cpu", mesh_shape), placements)
    return {name: _outcome(fn, x) for name, fn in _REDUCTIONS.items()}


@pytest.mark.parametrize("shape,placements", [
    ((3, 0), [Shard(0)]), ((3, 0), [Shard(1)]), ((3, 0), [Replicate()]), ((0, 4), [Shard(0)]),
    ((0, 4), [Shard(1)]), ((2, 5), [Shard(0)]), ((3, 2), [Shard(1)]),
], ids=str)
def test_reductions_over_empty_shards(shape, placements):
    """Every reduction gives dense torch's value, or raises where torch raises (on every rank)."""
    base = data("distinct", shape, gen(("empty", shape)))
    want = {name: _outcome(fn, base) for name, fn in _REDUCTIONS.items()}
    for rank_res in run_spmd(_empty_body, 4, (4,), base, placements):
        for name, (status, val) in rank_res.items():
            assert status == want[name][0], (name, status, val, want[name])
            if status == "ok":
                for a, b in zip(val, want[name][1]):
                    torch.testing.assert_close(a, b, equal_nan=True, msg=lambda m: f"{name}: {m}")


# -- addmv / addmm / baddbmm with a broadcast bias and empty shards -------------------------------

@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("op,shapes", [
    ("addmv", ((1,), (5, 3), (3,))), ("addmv", ((), (5, 3), (3,))), ("addmv", ((5,), (5, 3), (3,))),
    ("addmm", ((1,), (5, 3), (3, 6))), ("addmm", ((6,), (3, 4), (4, 6))),
    ("baddbmm", ((1, 6), (3, 2, 4), (3, 4, 6))),
], ids=str)
def test_biased_products_broadcast_bias(op, shapes, mesh_shape):
    """torch's kernels keep the bias's shape when a rank's product is empty; the result must not."""
    g = gen((op, shapes))
    fn = getattr(torch, op)
    check(lambda b, m, v: fn(b, m, v, beta=0.5, alpha=2.0), [data("any", s, g) for s in shapes], mesh_shape,
          limit=10, seed=(op, shapes))


# -- nll_loss backward on non-contiguous shards --------------------------------------------------

def _nll_body(mesh_shape, x, t, dy):
    mesh = init_device_mesh("cpu", mesh_shape)
    pl = [Shard(0)] + [Replicate()] * (len(mesh_shape) - 1)
    xl = distribute_tensor(x, mesh, pl).to_local()
    if mesh.get_rank() == 0:  # the same values in channels-last memory: torch's kernel refuses that layout
        xl = xl.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    xd = DTensor.from_local(xl, mesh, pl, shape=x.shape).requires_grad_()
    td = distribute_tensor(t, mesh, pl)
    loss = F.nll_loss(xd, td, reduction="none")
    loss.backward(distribute_tensor(dy, mesh, pl))
    return loss.full_tensor(), xd.grad.full_tensor()


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_nll_loss2d_backward_non_contiguous_shard(mesh_shape):
    """A shard in another memory layout on one rank only must not fail that rank alone (a hang under torchrun)."""
    g = gen("nll2d")
    x = data("any", (5, 4, 3, 2), g)
    t = torch.randint(0, 4, (5, 3, 2), generator=g)
    dy = data("any", (5, 3, 2), g)
    xd = x.clone().requires_grad_()
    want = F.nll_loss(xd, t, reduction="none")
    want.backward(dy)
    for loss, grad in run_spmd(_nll_body, 4, mesh_shape, x, t, dy):
        torch.testing.assert_close(loss, want.detach())
        torch.testing.assert_close(grad, xd.grad)


# -- in-place views, bool max/min, cat of 0-d tensors, allclose ------------------------------------

def _inplace_views(mesh_shape, x):
    mesh = init_device_mesh("cpu", mesh_shape)
    out = {}
    for name, fn in [("squeeze_", lambda t: t.squeeze_(1)), ("unsqueeze_", lambda t: t.unsqueeze_(0)),
                     ("t_", lambda t: t.squeeze_(1).t_()), ("transpose_", lambda t: t.transpose_(0, 2)),
                     ("swapdims_", lambda t: t.swapdims_(0, 2))]:
        d = distribute_tensor(x, mesh, [Shard(0)] + [Shard(2)] * (len(mesh_shape) - 1))
        base = d._local_tensor
        r = fn(d)
        out[name] = (r is d, tuple(d.shape), d.stride(), d.placements, d.full_tensor(),
                     d._local_tensor.untyped_storage().data_ptr() == base.untyped_storage().data_ptr())
    return out


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_inplace_view_ops(mesh_shape):
    """squeeze_/unsqueeze_/t_/transpose_/swapdims_ change the DTensor itself: shape, stride, placements, no copy."""
    x = data("any", (7, 1, 5), gen("inplace-view"))
    dense = {"squeeze_": x.clone().squeeze_(1), "unsqueeze_": x.clone().unsqueeze_(0),
             "t_": x.clone().squeeze_(1).t_(), "transpose_": x.clone().transpose_(0, 2),
             "swapdims_": x.clone().swapdims_(0, 2)}
    for res in run_spmd(_inplace_views, 4, mesh_shape, x):
        for name, (is_self, shape, stride, pl, full, shares) in res.items():
            want = dense[name]
            assert is_self and shape == tuple(want.shape) and stride == want.stride(), (name, shape, stride)
            assert shares, f"{name} copied the local tensor"
            assert any(isinstance(p, Shard) for p in pl), (name, pl)
            torch.testing.assert_close(full, want)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_bool_max_min_dim(mesh_shape):
    m = data("bool", (7, 5), gen("boolmax"))
    check(lambda t: (*t.max(0), *t.min(1, keepdim=True)), [m], mesh_shape, limit=12, grad=False, partial=("max",),
          seed="boolmax")


def _cat0d(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    a = distribute_tensor(torch.tensor(1.0), mesh, [Replicate()] * len(mesh_shape))
    try:
        torch.cat([a, a])
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_cat_of_zero_dim_tensors_raises_as_torch():
    with pytest.raises(RuntimeError, match="zero-dimensional"):
        torch.cat([torch.tensor(1.0), torch.tensor(2.0)])
    for msg in run_spmd(_cat0d, 4, (4,)):
        assert "zero-dimensional tensor (at position 0) cannot be concatenated" in msg, msg


def _allclose(mesh_shape, a, b):
    mesh = init_device_mesh("cpu", mesh_shape)
    pl = [Shard(0)] + [Replicate()] * (len(mesh_shape) - 1)
    da, db = distribute_tensor(a, mesh, pl), distribute_tensor(b, mesh, [Replicate()] * len(mesh_shape))
    return torch.allclose(da, db), torch.allclose(da, db + 1e-3), torch.allclose(da, db + 1e-3, atol=1e-2)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_allclose(mesh_shape):
    a = data("any", (7, 5), gen("allclose"))
    want = (True, torch.allclose(a, a + 1e-3), torch.allclose(a, a + 1e-3, atol=1e-2))
    assert want == (True, False, True)
    for got in run_spmd(_allclose, 4, mesh_shape, a, a.clone()):
        assert got == want


def _uneven_from_local(mesh_shape, sizes, run_check):
    mesh = init_device_mesh("cpu", mesh_shape)
    local = torch.arange(float(sum(sizes)))[sum(sizes[:mesh.get_rank()]):][:sizes[mesh.get_rank()]]
    with comm.recording() as log:
        d = DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=run_check)
    return tuple(d.shape), [e.kind for e in log.events if e.rank == mesh.get_rank()], d.full_tensor()


def test_uneven_from_local_gets_its_real_shape():
    """Without shape= the pieces' sizes are gathered (one small all-gather): chunk-rule pieces
    3, 3, 3, 1 make a 10-element tensor, where an even assumption would give each rank its own shape."""
    for shape, ops, full in run_spmd(_uneven_from_local, 4, (4,), [3, 3, 3, 1], None):
        assert shape == (10,) and ops == ["all_gather"]
        torch.testing.assert_close(full, torch.arange(10.0))


def test_even_from_local_with_run_check_false_moves_nothing():
    for shape, ops, _ in run_spmd(_uneven_from_local, 4, (4,), [2, 2, 2, 2], False):
        assert shape == (8,) and ops == []


def test_uneven_from_local_no_chunk_split_raises_on_every_rank():
    """Pieces 1, 2, 1, 2 are no torch.chunk split of 6: from_local raises on every rank, naming them."""
    with pytest.raises(ValueError, match=r"rank 0: local \(1,\), expected \(2,\)"):
        run_spmd(_uneven_from_local, 4, (4,), [1, 2, 1, 2], None)


def test_uneven_from_local_unchecked_says_what_to_do():
    with pytest.raises(RuntimeError, match=r"rank 0: \(1,\), rank 1: \(2,\).*pass shape="):
        run_spmd(_uneven_from_local, 4, (4,), [1, 2, 1, 2], False)


# -- repeat / tile / expand adding dims over a sharded dim; complex from real parts ---------------

@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name,fn", [
    ("repeat", lambda t: t.repeat(1, 2, 1, 1, 2)), ("repeat2", lambda t: t.repeat(2, 1, 3)),
    ("tile", lambda t: t.tile((2, 1, 1, 2))), ("expand", lambda t: t.expand(2, 3, 6, 5)),
    ("reshape_perm", lambda t: t.unsqueeze(0).expand(2, 6, 5).permute(1, 0, 2).reshape(3, 4, 5)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_repeat_tile_expand_new_dims(name, fn, mesh_shape):
    """Shapes with new leading dims over a sharded dim: each rank's reshape gets its local sizes."""
    check(fn, [data("any", (6, 5), gen(name))], mesh_shape, limit=12, seed=name)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_complex_from_parts(mesh_shape):
    g = gen("complex")
    check(lambda a, b: torch.complex(a, b) * (1 - 2j), [data("any", (7, 5), g), data("any", (7, 5), g)], mesh_shape,
          limit=12, seed="complex")


def test_op_sweep_sample():
    """A small draw of benchmarks/op_sweep.py: no wrong value, crash, hang or missing rule."""
    import op_sweep

    failures: list[str] = []
    totals = op_sweep.sweep(draws=2, seed=11, report=failures.append)
    assert totals["pass"] >= 2 * len(op_sweep.OPS), totals
    assert not [f for f in failures if not f.startswith("skipped")], failures


# -- torch.autograd.grad over plain and DTensor inputs ------------------------------------------

def _grads_keep_their_kinds():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(3)
    x = torch.randn(4, 3, requires_grad=True)  # the same plain tensor on every rank
    w = distribute_tensor(torch.randn(3, 5), mesh, [Shard(1)]).requires_grad_()
    y = (x @ w.full_tensor()).square().sum()
    gx, gw = torch.autograd.grad(y, [x, w])
    xd, wd = x.detach().requires_grad_(), w.full_tensor().detach().requires_grad_()
    want_x, want_w = torch.autograd.grad((xd @ wd).square().sum(), [xd, wd])
    return (type(gx) is torch.Tensor and torch.allclose(gx, want_x, atol=1e-5)
            and isinstance(gw, DTensor) and gw.placements == (Shard(1),)
            and torch.allclose(gw.full_tensor(), want_w, atol=1e-5))


def test_autograd_grad_returns_a_plain_inputs_gradient_plain():
    # torch.autograd.grad reaches DTensor.__torch_function__ when any input is a DTensor; its
    # results were taken for plain tensors built from shapes and wrapped as Replicate DTensors,
    # so a plain input's gradient silently came back a DTensor (and compiled backwards crashed)
    assert run_spmd(_grads_keep_their_kinds, 2) == [True, True]
