"""FSDP copy-in (``chunk_cat``) and copy-out (``split_with_sizes_copy``) kernels.

Both kernels are pure copies, written in
terms of strided views and ``Tensor.copy_`` so that every output byte is written exactly once.

Layout of ``chunk_cat(tensors, dim=D, num_chunks=k)``
-----------------------------------------------------
For input ``t_i`` with ``s_i = t_i.size(D)``, ``c_i = ceil(s_i / k)`` rows per chunk and
``r_i`` elements per row (product of the sizes after ``D``), the output is the contiguous tensor
``lead + [k, T]`` with ``T = sum_i c_i * r_i``.  Flattening ``lead`` to ``L`` elements, the output
is an ``(L, k, T)`` block and tensor ``i`` owns the column band ``[col_i, col_i + c_i * r_i)``
(``col_i`` = the sum of the earlier bands)::

            col_0         col_1               col_2
    chunk 0 | t_0 rows 0..c_0 | t_1 rows 0..c_1    | ...
    chunk 1 | t_0 rows c_0..  | t_1 rows c_1..     |
    ...     |  (zero pad)     |     (zero pad)     |

Chunk ``j`` of ``t_i`` is rows ``[j*c_i, (j+1)*c_i)`` along ``D``, which is exactly the row band
of chunk ``j`` with the rows laid out row-major.  So, with ``q_i = s_i // c_i`` full chunks and
``rem_i = s_i - q_i * c_i`` rows in the last partial chunk, tensor ``i`` needs at most:

* one ``copy_`` for all full chunks: the source ``t_i[..., :q_i*c_i, ...]`` viewed as
  ``lead + [q_i, c_i] + rest`` (splitting a dim is always a view) goes into the destination
  ``as_strided`` view ``lead + [q_i, c_i] + rest`` of ``out`` with strides ``(k*T, ..., T, r_i, ...)``;
* one ``copy_`` for the partial chunk ``q_i`` (``rem_i`` rows);
* at most two zero fills for the padding (the tail of chunk ``q_i`` and chunks
  ``q_i+1 .. k-1`` of the band).  Only padding is zeroed; ``out`` is usually uninitialised.

Why it is fast: there is no intermediate tensor (no ``pad``, no ``cat``), each input byte is
read once and each output byte written once, and each ``copy_`` moves a whole tensor (all its
full chunks at once).  TensorIterator coalesces the destination view into ``q_i`` (or
``L * q_i``) runs of ``c_i * r_i`` contiguous elements, so the copy runs at memcpy speed and is
parallelised over the intra-op threads like a plain ``copy_``.  The reference CPU path composes
``pad`` and ``cat`` and so moves every byte twice (plus an allocation).  Dtype widening
(bf16 -> fp32) happens inside ``copy_``.

Per-call Python overhead is kept small: the integer layout (all view sizes, strides and
offsets) is computed once per input signature (shapes, strides, dtypes, devices, ``dim``,
``num_chunks``) and cached, and a cache hit also means the checks already passed for
that signature.  A call then only builds the views with ``as_strided`` and issues one
``torch._foreach_copy_`` and one ``torch._foreach_zero_``.  That is a few microseconds per
tensor, negligible next to FSDP-sized copies (``benchmarks/chunk_cat.py`` measures it).

This module does not call the installed ``torch._chunk_cat`` even where it conforms, because on CPU the reference's ``out=`` path reaches half
memcpy speed at best and its ``out=`` rules differ from ours (it resizes a mis-shaped ``out`` and
accepts narrowing casts).

``split_with_sizes_copy`` is the inverse pattern: one ``copy_`` per piece from a ``narrow`` view
of the input into the caller's buffer.

Both kernels are copies, not differentiable ops: they run under ``torch.no_grad()`` (FSDP calls
them on gradients and on all-gather buffers).
"""
from __future__ import annotations

import math
import operator
import os
import warnings
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

__all__ = ["ChunkCatDimError", "SplitSizesError", "chunk_cat", "chunk_cat_numel", "split_with_sizes_copy"]


class ChunkCatDimError(IndexError, RuntimeError):
    """A ``dim`` out of range: an ``IndexError`` as in torch, and a ``RuntimeError`` as in the spec."""


class SplitSizesError(RuntimeError, ValueError):
    """``split_sizes`` do not sum to the split dim (``RuntimeError`` and ``ValueError``)."""


def _wrap_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ChunkCatDimError(
            f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    return dim + ndim if dim < 0 else dim


def _is_float_widening(src: torch.dtype, dst: torch.dtype) -> bool:
    if not (src.is_floating_point and dst.is_floating_point):
        return False
    try:
        return torch.promote_types(src, dst) == dst
    except (RuntimeError, TypeError):  # e.g. float8 types have no promotion
        return False


def _check_inputs(tensors: List[torch.Tensor], dim: int, num_chunks: int) -> Tuple[int, Tuple[int, ...]]:
    """Spec 1.2 checks; returns the normalized dim and the leading sizes."""
    if num_chunks < 1:
        raise RuntimeError(f"chunk_cat expects positive num_chunks, got {num_chunks}")
    if len(tensors) == 0:
        raise RuntimeError("chunk_cat expects a non-empty input tensor list")
    first = tensors[0]
    dtype, device, ndim0 = first.dtype, first.device, first.dim()
    same_ndim = True
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            raise RuntimeError(f"chunk_cat expects non-empty tensors, tensor {i} has shape {tuple(t.shape)}")
        if t.dtype != dtype:
            raise RuntimeError(f"chunk_cat expects all input tensors with the same dtype, "
                               f"got {dtype} (tensor 0) and {t.dtype} (tensor {i})")
        if t.device != device:
            raise RuntimeError(f"chunk_cat expects all input tensors on the same device, "
                               f"got {device} (tensor 0) and {t.device} (tensor {i})")
        if t.dim() != ndim0:
            same_ndim = False
    if same_ndim:
        if ndim0 == 0:
            raise ChunkCatDimError("chunk_cat expects tensors with at least one dimension, got 0-d tensors")
        d = _wrap_dim(dim, ndim0)
    else:
        if dim < 0:
            raise RuntimeError(f"chunk_cat expects non-negative dim when input tensors have different ndims, "
                               f"got dim={dim}")
        for i, t in enumerate(tensors):
            if dim >= t.dim():
                raise ChunkCatDimError(f"chunk_cat expects dim < ndim for all input tensors, "
                                       f"got dim={dim} and tensor {i} with ndim {t.dim()}")
        d = dim
    lead = tuple(first.shape[:d])
    for i, t in enumerate(tensors):
        if tuple(t.shape[:d]) != lead:
            raise RuntimeError(f"chunk_cat expects same sizes of 0,...,dim-1 dimensions for all tensors, "
                               f"got {lead} (tensor 0) and {tuple(t.shape[:d])} (tensor {i})")
    return d, lead


def _band_width(t: torch.Tensor, d: int, k: int) -> int:
    """Elements of one output row that tensor ``t`` owns: ``ceil(s / k) * r``."""
    shape = t.shape
    return -(-shape[d] // k) * math.prod(shape[d + 1:])


class _Plan(NamedTuple):
    """Integer layout of one ``chunk_cat`` signature: output shape and every view to copy or zero.

    ``copies``: ``(i, size, dst_stride, dst_offset, src_stride, src_offset)``, offsets relative to
    ``out``'s and ``tensors[i]``'s storage offsets.  ``zeros``: ``(size, stride, offset)`` in ``out``.
    """

    dim: int
    shape: Tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: torch.device
    copies: Tuple[Tuple[int, Tuple[int, ...], Tuple[int, ...], int, Tuple[int, ...], int], ...]
    zeros: Tuple[Tuple[Tuple[int, ...], Tuple[int, ...], int], ...]


_PLANS: Dict[tuple, _Plan] = {}
_MAX_PLANS = 256


def _make_plan(tensors: List[torch.Tensor], dim: int, k: int) -> _Plan:
    """Validate and lay out every tensor's band of the ``(L, k, T)`` output (module doc)."""
    d, lead = _check_inputs(tensors, dim, k)
    widths = [_band_width(t, d, k) for t in tensors]
    total = sum(widths)
    n_lead = math.prod(lead)
    row_stride = k * total                       # stride of the flattened lead dim in out
    out_lead: Tuple[int, ...] = ()
    acc = row_stride
    for size in reversed(lead):                  # contiguous strides of out's lead dims
        out_lead = (acc,) + out_lead
        acc *= size
    copies = []
    zeros: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    col = 0
    for i, (t, width) in enumerate(zip(tensors, widths)):
        sizes, strides = tuple(t.shape), t.stride()
        s = sizes[d]
        c = -(-s // k)                           # rows per chunk
        r = width // c                           # elements per row
        rest = sizes[d + 1:]
        out_rest: Tuple[int, ...] = ()
        acc = 1
        for size in reversed(rest):
            out_rest = (acc,) + out_rest
            acc *= size
        t_lead, sd, t_rest = strides[:d], strides[d], strides[d + 1:]
        q, rem = divmod(s, c)
        if q:                                    # all full chunks in one copy: lead + [q, c] + rest
            copies.append((i, lead + (q, c) + rest, out_lead + (total, r) + out_rest, col,
                           t_lead + (c * sd, sd) + t_rest, 0))
        if rem:                                  # the partial chunk q, then its zero tail
            copies.append((i, lead + (rem,) + rest, out_lead + (r,) + out_rest, q * total + col,
                           strides, q * c * sd))
            zeros.append(((n_lead, width - rem * r), (row_stride, 1), q * total + col + rem * r))
            q += 1
        if q < k:                                # empty trailing chunks
            zeros.append(((n_lead, k - q, width), (row_stride, total, 1), q * total + col))
        col += width
    shape = lead + (k, total)
    return _Plan(d, shape, n_lead * k * total, tensors[0].dtype, tensors[0].device, tuple(copies), tuple(zeros))


def _get_plan(tensors: List[torch.Tensor], dim: int, k: int) -> _Plan:
    """Cached ``_make_plan``: the key holds everything the checks and the layout depend on."""
    try:
        dim, k = operator.index(dim), operator.index(k)
    except TypeError:
        raise RuntimeError(f"chunk_cat expects integer dim and num_chunks, got {dim!r} and {k!r}") from None
    key = (dim, k, *[(t.shape, t.stride(), t.dtype, t.device) for t in tensors])
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(tensors, dim, k)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def chunk_cat_numel(tensors: Sequence[torch.Tensor], dim: int, num_chunks: int) -> int:
    """Number of elements of ``chunk_cat(tensors, dim, num_chunks)`` (to size an ``out`` buffer)."""
    return _get_plan(_as_tensor_list(tensors), dim, num_chunks).numel


def _as_tensor_list(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise RuntimeError(f"chunk_cat expects tensors, got {type(t).__name__} at index {i}")
    return tensors


def chunk_cat(tensors: Sequence[torch.Tensor], dim: int, num_chunks: int,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pad each tensor along ``dim`` to a multiple of ``num_chunks``, chunk it and concatenate the chunks.

    Returns a new contiguous ``lead + [num_chunks, sum_i c_i * r_i]`` tensor, or writes
    into ``out`` in place and returns it (contiguous, same device, same dtype or a float
    widening, exact numel in any shape; an empty ``out`` is resized).  Raises ``RuntimeError``.
    """
    tensors = _as_tensor_list(tensors)
    plan = _get_plan(tensors, dim, num_chunks)
    if out is None:
        out = torch.empty(plan.shape, dtype=plan.dtype, device=plan.device)
    else:
        _check_chunk_cat_out(out, plan)
    with torch.no_grad():
        if _one_launch(plan.device, [*tensors, out]):
            from . import gpu

            gpu.chunk_cat(tensors, plan.dim, num_chunks, out)
        else:
            _write_strided(plan, tensors, out)
    return out


def _one_launch(device: torch.device, tensors: Sequence[torch.Tensor]) -> bool:
    """Use the one-launch Triton kernels (``.gpu``)?  ``SHARDTENSOR_TRITON``: ``auto`` (default: on
    CUDA when Triton imports), ``1`` (on any device: CPU tensors need ``TRITON_INTERPRET=1``), ``0``."""
    mode = os.environ.get("SHARDTENSOR_TRITON", "auto")
    if mode == "0" or (mode != "1" and device.type != "cuda"):
        return False
    from . import gpu

    return gpu.available() and gpu.supports(tensors)


def _write_strided(plan: _Plan, tensors: List[torch.Tensor], out: torch.Tensor) -> None:
    """The per-tensor path: one strided ``copy_`` per band piece and the padding zeroed (module doc)."""
    base = out.storage_offset()
    dsts = [out.as_strided(size, dst_stride, base + dst_off) for _, size, dst_stride, dst_off, _, _ in plan.copies]
    srcs = [tensors[i].as_strided(size, src_stride, tensors[i].storage_offset() + src_off)
            for i, size, _, _, src_stride, src_off in plan.copies]
    torch._foreach_copy_(dsts, srcs)
    if plan.zeros:
        torch._foreach_zero_([out.as_strided(size, stride, base + off) for size, stride, off in plan.zeros])


def _chunk_cat_strided(tensors: Sequence[torch.Tensor], dim: int, num_chunks: int, out: torch.Tensor) -> torch.Tensor:
    """``chunk_cat(out=)`` on the per-tensor path whatever the device (benchmarks compare the two)."""
    tensors = _as_tensor_list(tensors)
    plan = _get_plan(tensors, dim, num_chunks)
    _check_chunk_cat_out(out, plan)
    with torch.no_grad():
        _write_strided(plan, tensors, out)
    return out


def _check_chunk_cat_out(out: torch.Tensor, plan: _Plan) -> None:
    """Spec 1.4 checks on ``out`` (all before any write); resizes an empty ``out``."""
    if not isinstance(out, torch.Tensor):
        raise RuntimeError(f"chunk_cat expects out to be a tensor, got {type(out).__name__}")
    if out.device != plan.device:
        raise RuntimeError(f"chunk_cat expects out on the inputs' device {plan.device}, got {out.device}")
    if out.dtype != plan.dtype and not _is_float_widening(plan.dtype, out.dtype):
        raise RuntimeError(f"chunk_cat expects out dtype {plan.dtype} or a wider floating dtype, got {out.dtype}")
    if out.numel() == 0:
        out.resize_(plan.shape)
        return
    if out.numel() != plan.numel:
        raise RuntimeError(f"chunk_cat expects out with {plan.numel} elements (shape {list(plan.shape)} or any "
                           f"view of it), got {out.numel()} elements (shape {list(out.shape)})")
    if not out.is_contiguous():
        raise RuntimeError(f"chunk_cat expects a contiguous out, got strides {out.stride()}")


# ---------------------------------------------------------------------------------------------
# split_with_sizes_copy
# ---------------------------------------------------------------------------------------------

def _resize_output(t: torch.Tensor, shape: Tuple[int, ...]) -> None:
    """Resize ``t`` to ``shape``: silently when empty, with a warning otherwise (torch's out= rule)."""
    if tuple(t.shape) == shape:
        return
    if t.numel() != 0:
        warnings.warn(f"An output with one or more elements was resized since it had shape {list(t.shape)}, "
                      f"which does not match the required output shape {list(shape)}.", UserWarning,
                      stacklevel=3)
    t.resize_(shape)


def split_with_sizes_copy(tensor: torch.Tensor, split_sizes: Sequence[int], dim: int = 0,
                          out: Optional[Sequence[torch.Tensor]] = None) -> Optional[List[torch.Tensor]]:
    """Split ``tensor`` along ``dim`` into pieces of ``split_sizes`` and copy them.

    Without ``out`` returns a list of new contiguous tensors.  With ``out`` copies piece ``i`` into
    ``out[i]`` (resized to the piece's shape, with a warning if it was non-empty) and returns
    ``None``.  ``out[i]`` must have exactly ``tensor``'s dtype and device.  All checks run before
    any write.
    """
    if tensor.dim() == 0:
        raise RuntimeError("split_with_sizes_copy expects at least a 1-dimensional tensor")
    d = _wrap_dim(dim, tensor.dim())
    sizes = [int(s) for s in split_sizes]
    if any(s < 0 for s in sizes):
        raise RuntimeError(f"split_with_sizes_copy expects non-negative split_sizes, got {sizes}")
    if sum(sizes) != tensor.shape[d]:
        raise SplitSizesError(f"split_with_sizes_copy expects split_sizes to sum exactly to {tensor.shape[d]} "
                              f"(the input's size at dimension {d}), but got split_sizes={sizes}")
    if out is None:
        pieces = []
        off = 0
        for s in sizes:
            pieces.append(tensor.narrow(d, off, s).clone(memory_format=torch.contiguous_format))
            off += s
        return pieces
    out = list(out)
    if len(out) != len(sizes):
        raise RuntimeError(f"split_with_sizes_copy expects an out= argument of size {len(sizes)}, got {len(out)}")
    for i, o in enumerate(out):
        if not isinstance(o, torch.Tensor):
            raise RuntimeError(f"split_with_sizes_copy expects out[{i}] to be a tensor, got {type(o).__name__}")
        if o.dtype != tensor.dtype:
            raise RuntimeError(f"split_with_sizes_copy expects out[{i}] to have dtype {tensor.dtype}, got {o.dtype}")
        if o.device != tensor.device:
            raise RuntimeError(f"split_with_sizes_copy expects out[{i}] on device {tensor.device}, got {o.device}")
    shape = list(tensor.shape)
    for o, s in zip(out, sizes):
        shape[d] = s
        _resize_output(o, tuple(shape))
    with torch.no_grad():
        if _one_launch(tensor.device, [tensor, *out]) and all(o.is_contiguous() for o in out):
            from . import gpu

            gpu.split_with_sizes_copy(tensor, d, sizes, out)
        else:
            _split_strided(tensor, d, sizes, out)
    return None


def _split_strided(tensor: torch.Tensor, d: int, sizes: Sequence[int], out: Sequence[torch.Tensor]) -> None:
    """One ``copy_`` per piece from a ``narrow`` view (the per-tensor path; ``out`` already sized)."""
    off = 0
    for o, s in zip(out, sizes):
        if s:
            o.copy_(tensor.narrow(d, off, s))
        off += s
