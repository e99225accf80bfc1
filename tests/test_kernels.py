"""FSDP copy kernels: ``chunk_cat`` and ``split_with_sizes_copy``.

Two oracles: the installed ``torch._chunk_cat`` / ``torch.split_with_sizes_copy`` (results must be
bit-identical) and an independent reference model (pad + view + cat).  The FSDP
round trips (tests 7, 10, 11) simulate the world with plain tensors: rank ``r``'s reduce-scatter
output is row ``r`` of the rank-average of the flat inputs, and an all-gather is a concatenation.
"""
from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardtensor.kernels import ChunkCatDimError, SplitSizesError, chunk_cat, chunk_cat_numel, split_with_sizes_copy

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------

def make(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Deterministic test values of any dtype (floats include negative zero and non-integers)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        if x.numel():
            x.view(-1)[0] = -0.0
        if dtype.is_complex:
            x = torch.complex(x, -x)
        return x.to(dtype)
    lo, hi = (0, 255) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor (bit-identity, NaN- and -0.0-safe)."""
    return t.contiguous().view(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(bits(a), bits(b))


def reference(tensors, dim: int, k: int) -> torch.Tensor:
    """Spec 1.1 as written: zero-pad dim D to k*c_i, view lead + [k, c_i*r_i], cat along D+1."""
    nd = tensors[0].dim()
    d = dim + nd if dim < 0 else dim
    views = []
    for t in tensors:
        s = t.shape[d]
        c = -(-s // k)
        pad = [0, 0] * (t.dim() - d - 1) + [0, k * c - s]
        p = F.pad(t, pad) if t.dtype != torch.bool else F.pad(t.to(torch.uint8), pad).bool()
        views.append(p.reshape(tuple(t.shape[:d]) + (k, -1)))
    return torch.cat(views, dim=d + 1)


def storage_range(t: torch.Tensor):
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = storage_range(a), storage_range(b)
    return a0 < b1 and b0 < a1


A = torch.arange(1, 9.).view(2, 4)
B = torch.arange(11, 20.).view(3, 3)
C = torch.tensor([[21., 22.]])
D4 = torch.arange(31, 39.).view(4, 2)


# ---------------------------------------------------------------------------------------
# 1. worked examples
# ---------------------------------------------------------------------------------------

def test_example_1():
    out = chunk_cat([A, B, C], 0, 3)
    assert out.tolist() == [[1, 2, 3, 4, 11, 12, 13, 21, 22],
                            [5, 6, 7, 8, 14, 15, 16, 0, 0],
                            [0, 0, 0, 0, 17, 18, 19, 0, 0]]


def test_example_2():
    out = chunk_cat([A, B, C, D4], 0, 2)
    assert out.tolist() == [[1, 2, 3, 4, 11, 12, 13, 14, 15, 16, 21, 22, 31, 32, 33, 34],
                            [5, 6, 7, 8, 17, 18, 19, 0, 0, 0, 0, 0, 35, 36, 37, 38]]


def test_example_3():
    X = torch.arange(1, 11.).view(2, 5)
    Y = torch.arange(101, 107.).view(2, 3)
    out = chunk_cat([X, Y], 1, 2)
    assert out.shape == (2, 2, 5)
    assert out[0].tolist() == [[1, 2, 3, 101, 102], [4, 5, 0, 103, 0]]
    assert out[1].tolist() == [[6, 7, 8, 104, 105], [9, 10, 0, 106, 0]]
    assert_bit_equal(chunk_cat([X, Y], -1, 2), out)


def test_example_4_mixed_ndim():
    a = torch.arange(1, 6.)
    b = torch.arange(11, 23.).view(4, 3)
    out = chunk_cat([a, b], 0, 2)
    assert out.tolist() == [[1, 2, 3, 11, 12, 13, 14, 15, 16], [4, 5, 0, 17, 18, 19, 20, 21, 22]]
    with pytest.raises(RuntimeError, match="non-negative dim"):
        chunk_cat([a, b], -1, 2)


def test_k1_is_flattening_concat():
    x, y = make((3, 4)), make((2, 5, 2), seed=1)
    out = chunk_cat([x, y], 0, 1)
    assert out.shape == (1, 32)
    assert_bit_equal(out[0], torch.cat([x.reshape(-1), y.reshape(-1)]))


# ---------------------------------------------------------------------------------------
# 2./3. random lists vs torch._chunk_cat and the reference model
# ---------------------------------------------------------------------------------------

@st.composite
def chunk_cat_case(draw):
    ndim = draw(st.integers(1, 4))
    n = draw(st.integers(1, 6))
    k = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(DTYPES))
    same_ndim = draw(st.booleans())
    d = draw(st.integers(0, ndim - 1))
    lead = [draw(st.integers(1, 4)) for _ in range(d)]
    no_pad = draw(st.integers(0, 3)) == 0
    tensors = []
    for i in range(n):
        s = draw(st.integers(1, 17))
        if no_pad:
            s = k * draw(st.integers(1, 3))
        n_rest = ndim - 1 - d if same_ndim else draw(st.integers(0, 2))
        rest = [draw(st.integers(1, 4)) for _ in range(n_rest)]
        shape = lead + [s] + rest
        t = make(shape, dtype, seed=draw(st.integers(0, 2 ** 16)))
        layout = draw(st.sampled_from(["contig", "transposed", "sliced", "offset"]))
        if layout == "transposed" and t.dim() >= 2:
            t = t.transpose(0, -1).contiguous().transpose(0, -1)
        elif layout == "sliced":
            t = make([x * 2 for x in shape], dtype, seed=i)[tuple(slice(None, None, 2) for _ in shape)]
            t = t.clone() if draw(st.booleans()) else t
        elif layout == "offset":
            t = make([t.numel() + 3], dtype, seed=i)[3:].view(shape)
        tensors.append(t)
    ndims = {t.dim() for t in tensors}
    use_neg = len(ndims) == 1 and draw(st.booleans())
    dim = d - tensors[0].dim() if use_neg else d
    return tensors, dim, k


@SETTINGS
@given(chunk_cat_case())
def test_random_matches_torch_and_reference(case):
    tensors, dim, k = case
    out = chunk_cat(tensors, dim, k)
    assert_bit_equal(out, torch._chunk_cat(tensors, dim, k))
    assert_bit_equal(out, reference(tensors, dim, k))
    assert out.is_contiguous()
    assert not any(aliases(out, t) for t in tensors)
    assert chunk_cat_numel(tensors, dim, k) == out.numel()
    # out= into uninitialised memory viewed (k, -1) for dim 0 and flat otherwise
    buf = torch.full((out.numel(),), 7, dtype=out.dtype) if out.dtype != torch.bool else torch.ones(out.numel(),
                                                                                                     dtype=torch.bool)
    ptr = buf.data_ptr()
    target = buf.view(k, -1) if out.dim() == 2 else buf
    assert chunk_cat(tensors, dim, k, out=target) is target
    assert buf.data_ptr() == ptr
    assert_bit_equal(buf.view(out.shape), out)


def test_no_padding_still_new_tensor():
    x = make((8, 3))
    out = chunk_cat([x], 0, 4)
    assert out.shape == (4, 6)
    assert_bit_equal(out.view(-1), x.view(-1))
    assert not aliases(out, x)
    out[0, 0] = 99
    assert x[0, 0] != 99


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_match_torch(dtype):
    tensors = [make((5, 3), dtype, 1), make((2,), dtype, 2), make((9, 2, 2), dtype, 3)]
    for k in (1, 3, 8):
        assert_bit_equal(chunk_cat(tensors, 0, k), torch._chunk_cat(tensors, 0, k))


def test_conj_and_neg_views():
    z = make((5, 3), torch.complex64)
    zc = z.conj()
    assert zc.is_conj()
    assert_bit_equal(chunk_cat([zc, z], 0, 2), torch._chunk_cat([zc.resolve_conj(), z], 0, 2))


def test_expanded_input():
    x = torch.arange(3.).view(3, 1).expand(3, 4)      # stride 0
    assert_bit_equal(chunk_cat([x], 0, 2), torch._chunk_cat([x.contiguous()], 0, 2))
    assert_bit_equal(chunk_cat([x], 1, 3), torch._chunk_cat([x.contiguous()], 1, 3))


def test_requires_grad_inputs():
    x = make((5, 4)).requires_grad_()
    out = chunk_cat([x], 0, 2)
    assert_bit_equal(out, torch._chunk_cat([x.detach()], 0, 2))


def test_large_uneven_matches_torch():
    tensors = [make((1001, 64), seed=1), make((7,), seed=2), make((64, 33), seed=3), make((4096,), seed=4)]
    for k in (3, 8, 64):
        assert_bit_equal(chunk_cat(tensors, 0, k), torch._chunk_cat(tensors, 0, k))
    tensors = [make((6, 1001), seed=1), make((6, 7, 5), seed=2)]
    for k in (2, 8):
        assert_bit_equal(chunk_cat(tensors, 1, k), torch._chunk_cat(tensors, 1, k))
        assert_bit_equal(chunk_cat(tensors, 1, k), reference(tensors, 1, k))


# ---------------------------------------------------------------------------------------
# 4. input errors
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tensors,dim,k,match", [
    ([A, B], 0, 0, "positive num_chunks"),
    ([A, B], 0, -2, "positive num_chunks"),
    ([], 0, 2, "non-empty input tensor list"),
    ([A, torch.empty(0, 4)], 0, 2, "non-empty tensors"),
    ([A, torch.empty(4, 0)], 1, 2, "non-empty tensors"),
    ([A, B.double()], 0, 2, "same dtype"),
    ([A, torch.empty(2, 2, device="meta")], 0, 2, "same device"),
    ([torch.arange(5.), A], -1, 2, "non-negative dim"),
    ([torch.arange(5.), A], 1, 2, "dim < ndim"),
    ([A, B], 1, 2, "same sizes of 0,...,dim-1"),
    ([A, torch.ones(2, 3, 4), torch.ones(3, 1)], 1, 2, "same sizes of 0,...,dim-1"),
    ([A, B], 2, 2, "Dimension out of range"),
    ([A, B], -3, 2, "Dimension out of range"),
    ([torch.tensor(1.)], 0, 2, "at least one dimension"),
    ([A], 0, 2.0, "integer"),
    ([A], 0.0, 2, "integer"),
    ([A, "x"], 0, 2, "expects tensors"),
])
def test_input_errors(tensors, dim, k, match):
    with pytest.raises(RuntimeError, match=match):
        chunk_cat(tensors, dim, k)


def test_dim_error_is_also_index_error():
    with pytest.raises(IndexError):
        chunk_cat([A], 2, 2)
    assert issubclass(ChunkCatDimError, RuntimeError)


def test_plan_cache_does_not_skip_checks():
    x, y = make((5, 3)), make((4, 3))
    chunk_cat([x, y], 0, 2)                                 # cache the valid signature
    with pytest.raises(RuntimeError, match="same dtype"):
        chunk_cat([x, y.double()], 0, 2)
    with pytest.raises(RuntimeError, match="positive"):
        chunk_cat([x, y], 0, 0)
    # same shapes, different strides and storage offsets: still correct
    xt = make((3, 5)).t()
    yo = make((13,))[1:].view(4, 3)
    assert_bit_equal(chunk_cat([xt, yo], 0, 2), torch._chunk_cat([xt, yo], 0, 2))


# ---------------------------------------------------------------------------------------
# 5./6. out=
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("view", ["k,-1", "full", "flat"])
def test_out_in_place_with_garbage(view):
    tensors = [A, B, C, D4]
    ref = torch._chunk_cat(tensors, 0, 2)
    buf = torch.full((ref.numel(),), float("nan"))
    target = {"k,-1": buf.view(2, -1), "full": buf.view(ref.shape), "flat": buf}[view]
    shape, ptr = target.shape, target.data_ptr()
    res = chunk_cat(tensors, 0, 2, out=target)
    assert res is target and res.shape == shape and res.data_ptr() == ptr
    assert_bit_equal(buf.view(ref.shape), ref)


def test_out_with_storage_offset_writes_only_its_range():
    tensors = [make((7, 3)), make((5,), seed=1)]
    ref = chunk_cat(tensors, 0, 4)
    big = torch.full((ref.numel() + 20,), -1.0)
    target = big[10:10 + ref.numel()]
    chunk_cat(tensors, 0, 4, out=target)
    assert_bit_equal(target.view(ref.shape), ref)
    assert (big[:10] == -1).all() and (big[10 + ref.numel():] == -1).all()


@pytest.mark.parametrize("src,dst", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                     (torch.float32, torch.float64), (torch.bfloat16, torch.float64)])
def test_out_float_widening(src, dst):
    tensors = [make((7, 3), src), make((5,), src, 1), make((2, 2), src, 2)]
    ref = torch._chunk_cat(tensors, 0, 4)
    out = torch.full((ref.numel(),), float("nan"), dtype=dst).view(4, -1)
    chunk_cat(tensors, 0, 4, out=out)
    assert_bit_equal(out, ref.to(dst))
    theirs = torch.empty(ref.shape, dtype=dst)
    torch._chunk_cat(tensors, 0, 4, out=theirs)
    assert_bit_equal(out, theirs)


def test_out_empty_is_resized():
    out = torch.empty(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = chunk_cat([A, B, C], 0, 3, out=out)
    assert res is out and out.shape == (3, 9)
    assert_bit_equal(out, torch._chunk_cat([A, B, C], 0, 3))


@pytest.mark.parametrize("make_out,match", [
    (lambda n: torch.full((n + 1,), 5.0), "elements"),
    (lambda n: torch.full((n - 1,), 5.0), "elements"),
    (lambda n: torch.full((n,), 5.0, device="meta"), "device"),
    (lambda n: torch.full((n,), 5, dtype=torch.int64), "dtype"),
    (lambda n: torch.full((n,), 5.0, dtype=torch.float16), "dtype"),
    (lambda n: torch.full((n,), 5.0, dtype=torch.bfloat16), "dtype"),
    (lambda n: torch.full((2 * n,), 5.0)[::2], "contiguous"),
    (lambda n: torch.full((9, 3), 5.0).t(), "contiguous"),
])
def test_out_errors_before_any_write(make_out, match):
    tensors = [A, B, C]
    n = 27
    out = make_out(n)
    before = out.clone() if out.device.type == "cpu" else None
    with pytest.raises(RuntimeError, match=match):
        chunk_cat(tensors, 0, 3, out=out)
    if before is not None:
        assert torch.equal(out, before)


def test_out_bf16_to_fp16_and_int_to_float_rejected():
    with pytest.raises(RuntimeError, match="dtype"):
        chunk_cat([make((4, 2), torch.bfloat16)], 0, 2, out=torch.empty(8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="dtype"):
        chunk_cat([make((4, 2), torch.int32)], 0, 2, out=torch.empty(8, dtype=torch.float32))


# ---------------------------------------------------------------------------------------
# 7. FSDP reduce-scatter copy-in, simulated world
# ---------------------------------------------------------------------------------------

def test_fsdp_reduce_scatter_copy_in():
    W = 4
    rows = [7, 3, 8, 1]
    cols = [5, 2, 3, 6]
    grads = [[make((s, c), torch.bfloat16, seed=100 * r + i) for i, (s, c) in enumerate(zip(rows, cols))]
             for r in range(W)]
    padded = [-(-s // W) * W * c for s, c in zip(rows, cols)]
    n_in = sum(padded)
    inputs = []
    for r in range(W):
        inp = torch.empty(n_in, dtype=torch.float32)                 # reduce dtype fp32, bf16 -> fp32 in the copy
        chunk_cat(grads[r], 0, W, out=inp.view(W, -1))
        inputs.append(inp)
    avg = torch.stack(inputs).mean(0)                                 # the reduce-scatter "avg"
    for r in range(W):
        output = avg.view(W, -1)[r]
        off = 0
        for i, (s, c) in enumerate(zip(rows, cols)):
            ci = -(-s // W)
            local_rows = min(ci, max(0, s - r * ci))
            shard = output[off:off + local_rows * c].view(local_rows, c)
            dense = torch.stack([grads[q][i].float() for q in range(W)]).mean(0)
            piece = torch.chunk(dense, W, 0)
            expected = piece[r] if r < len(piece) else dense[:0]
            assert shard.shape == expected.shape
            torch.testing.assert_close(shard, expected, rtol=0, atol=1e-6)
            off += padded[i] // W


# ---------------------------------------------------------------------------------------
# 8./9. split_with_sizes_copy
# ---------------------------------------------------------------------------------------

@st.composite
def split_case(draw):
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(0, 6)) for _ in range(ndim)]
    dim = draw(st.integers(-ndim, ndim - 1))
    d = dim % ndim
    shape[d] = draw(st.integers(0, 12))
    sizes, left = [], shape[d]
    while left or not sizes or draw(st.booleans()):
        s = draw(st.integers(0, left))
        sizes.append(s)
        left -= s
        if len(sizes) > 6:
            sizes.append(left)
            break
    dtype = draw(st.sampled_from(DTYPES))
    x = make(shape, dtype, seed=draw(st.integers(0, 1000)))
    if ndim >= 2 and draw(st.booleans()):
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    return x, sizes, dim


@SETTINGS
@given(split_case(), st.sampled_from(["none", "empty", "exact", "strided"]))
def test_split_random_matches_torch(case, out_kind):
    x, sizes, dim = case
    ref = torch.split_with_sizes_copy(x, sizes, dim)
    if out_kind == "none":
        res = split_with_sizes_copy(x, sizes, dim)
        assert len(res) == len(ref)
        for a, b in zip(res, ref):
            assert_bit_equal(a, b)
            assert a.is_contiguous()
            assert a.numel() == 0 or not aliases(a, x)
        return
    if out_kind == "empty":
        outs = [torch.empty(0, dtype=x.dtype) for _ in sizes]
    elif out_kind == "exact":
        outs = [torch.empty_like(r) for r in ref]
    else:                                                            # non-contiguous destination views
        outs = [torch.empty(tuple(r.shape[::-1]), dtype=x.dtype).permute(*range(r.dim() - 1, -1, -1))
                for r in ref]
    ptrs = [o.data_ptr() for o in outs]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert split_with_sizes_copy(x, sizes, dim, out=outs) is None
    for o, r, p in zip(outs, ref, ptrs):
        assert_bit_equal(o, r)
        if out_kind != "empty":
            assert o.data_ptr() == p


def test_split_out_zero_sizes_and_negative_dim():
    x = make((3, 7))
    outs = [torch.empty(3, 0), torch.empty(3, 4), torch.empty(3, 0), torch.empty(3, 3)]
    assert split_with_sizes_copy(x, [0, 4, 0, 3], -1, out=outs) is None
    for o, r in zip(outs, torch.split_with_sizes(x, [0, 4, 0, 3], -1)):
        assert_bit_equal(o, r)


def test_split_out_resize():
    x = make((6, 4))
    empty = [torch.empty(0), torch.empty(0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split_with_sizes_copy(x, [2, 4], 0, out=empty)
    assert [tuple(o.shape) for o in empty] == [(2, 4), (4, 4)]
    wrong = [torch.empty(8), torch.empty(4, 4)]
    with pytest.warns(UserWarning, match="resized"):
        split_with_sizes_copy(x, [2, 4], 0, out=wrong)
    assert tuple(wrong[0].shape) == (2, 4)
    assert_bit_equal(wrong[0], x[:2])
    assert_bit_equal(wrong[1], x[2:])


@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((make((2, 5)), [2, 4], 1), {}, RuntimeError, "sum exactly"),
    ((make((2, 5)), [2, 4], 1), {}, ValueError, "sum exactly"),
    ((make((2, 5)), [-1, 6], 1), {}, RuntimeError, "non-negative"),
    ((make((2, 5)), [2, 3], 1), {"out": [torch.empty(2, 2)]}, RuntimeError, "size 2"),
    ((make((2, 5)), [2, 3], 1), {"out": [torch.empty(2, 2), torch.empty(2, 3, dtype=torch.float64)]},
     RuntimeError, "dtype"),
    ((make((2, 5)), [2, 3], 1), {"out": [torch.empty(2, 2), torch.empty(2, 3, device="meta")]},
     RuntimeError, "device"),
    ((torch.tensor(1.), [1], 0), {}, RuntimeError, "1-dimensional"),
    ((make((2, 5)), [2, 3], 2), {}, RuntimeError, "out of range"),
    ((make((2, 5)), [2, 3], -3), {}, IndexError, "out of range"),
])
def test_split_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        split_with_sizes_copy(*args, **kwargs)


def test_split_errors_before_any_write():
    x = make((2, 5))
    outs = [torch.full((2, 2), 9.0), torch.empty(2, 3, dtype=torch.float64)]
    with pytest.raises(RuntimeError):
        split_with_sizes_copy(x, [2, 3], 1, out=outs)
    assert (outs[0] == 9).all()


def test_split_sizes_error_type():
    assert issubclass(SplitSizesError, RuntimeError) and issubclass(SplitSizesError, ValueError)


# ---------------------------------------------------------------------------------------
# 10./11. FSDP all-gather copy-out, simulated world
# ---------------------------------------------------------------------------------------

def _all_gather_round_trip(params, W, byte_view):
    """Shard each param S(0) (torch.chunk), all-gather the padded flat inputs, copy out, unpad."""
    cs = [-(-p.shape[0] // W) for p in params]
    rests = [math.prod(p.shape[1:]) for p in params]
    dtype = torch.uint8 if byte_view else params[0].dtype
    item = [p.element_size() if byte_view else 1 for p in params]
    ns = [c * r * it for c, r, it in zip(cs, rests, item)]             # per-rank elements (bytes) of param i
    M = sum(ns)
    output = torch.full((W * M,), 0xAB if byte_view else 7, dtype=dtype)
    for r in range(W):                                                 # each rank's all-gather input slot
        off = r * M
        for p, c, n, rest in zip(params, cs, ns, rests):
            shard = torch.chunk(p, W, 0)
            local = shard[r] if r < len(shard) else p[:0]
            flat = torch.zeros(c * rest, dtype=p.dtype)
            flat[:local.numel()] = local.reshape(-1)
            output[off:off + n] = flat.view(torch.uint8) if byte_view else flat
            off += n
    bufs = [torch.full((W * c, *p.shape[1:]), 3, dtype=p.dtype) for p, c in zip(params, cs)]
    outs = [(b.view(-1).view(torch.uint8) if byte_view else b.view(-1)).view(W, n) for b, n in zip(bufs, ns)]
    assert split_with_sizes_copy(output.view(W, M), ns, dim=1, out=outs) is None
    return [b[:p.shape[0]] for b, p in zip(bufs, params)]


def test_fsdp_all_gather_copy_out():
    params = [make((7, 5), seed=1), make((3, 2), seed=2), make((8, 3), seed=3)]
    for got, p in zip(_all_gather_round_trip(params, 4, byte_view=False), params):
        assert_bit_equal(got, p)


def test_fsdp_mixed_dtype_uint8_round_trip():
    params = [make((7, 5), torch.float32, 1), make((3, 2), torch.bfloat16, 2), make((8, 3), torch.float16, 3),
              make((5,), torch.int64, 4), make((2, 3), torch.float64, 5)]
    for got, p in zip(_all_gather_round_trip(params, 4, byte_view=True), params):
        assert_bit_equal(got, p)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
