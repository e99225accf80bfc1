"""One-launch Triton kernels for ``chunk_cat`` and ``split_with_sizes_copy`` on CUDA.

The CPU kernels issue one strided ``copy_`` per input (or per piece); on a GPU each of those is
a kernel launch, so a call over hundreds of small FSDP parameters is bound by launches.  These
kernels copy every tensor of a call in one launch.

Layout (as in :mod:`.chunk_cat`): the output is ``R = L * k`` rows of ``T`` elements; input
``i`` is ``L`` rows of ``n_i = s_i * r_i`` contiguous elements and owns the column band
``[col_i, col_i + w_i)`` of every output row, ``w_i = c_i * r_i``.  Output row ``(l, j)`` of the
band holds input elements ``l * n_i + j * w_i + p`` for ``p < w_i`` where ``j * w_i + p < n_i``,
zeros after.  The grid is (column blocks of all bands, rows): a program finds its tensor by
counting the band block offsets at or below its block number, then copies one block, casting to
``out``'s dtype (bf16 -> fp32 widening happens in the store) and writing zeros where the input
ends.  ``split_with_sizes_copy`` is the same walk read backwards: one input row band per piece.

The inputs live at different addresses; the kernel takes the first as its base pointer and the
others as element offsets from it (a flat address space, as CUDA's unified addressing gives).
Those offsets and the band table go to the GPU as one small int64 tensor, copied from pinned
memory without a host sync and cached per (layout, addresses, stream), so a call that repeats
(FSDP's all-gather copy-in of the same shards every step) sends nothing.  When every offset and
width is a multiple of a 16-byte vector, the kernel is told so and moves 16 bytes per access.

Triton is optional (``pip install 'shardtensor[gpu]'``; it ships with CUDA builds of torch).
Under ``TRITON_INTERPRET=1`` (set before Triton is imported) the kernels run on CPU tensors in
Triton's interpreter, which is how the CPU test suite checks them.  ``supports`` says which
calls they take; the others keep the per-tensor path.
"""
import math
from collections import OrderedDict
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU kernels serve; see available()
    triton = None

MAX_ROWS = 65535  # CUDA's limit on the grid's second axis; taller outputs launch in row slices
_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
                     torch.int32, torch.int64, torch.uint8, torch.bool})


def available() -> bool:
    """True when Triton imports (it ships with CUDA builds of torch)."""
    return triton is not None


def supports(tensors: Sequence[torch.Tensor]) -> bool:
    """Dtypes Triton loads, without a conjugate or negative bit (Triton reads raw memory)."""
    return all(t.dtype in _DTYPES and not t.is_conj() and not t.is_neg() for t in tensors)


def _band_block(meta, row0, NT: tl.constexpr, FIELDS: tl.constexpr):
    """This program's row, the address of its band's ``FIELDS`` fields, and its block's index
    within the band (``meta``: ``NT`` band block starts, then each band's fields)."""
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64) + row0
    i = tl.sum((tl.load(meta + tl.arange(0, NT)) <= pid).to(tl.int32)) - 1
    return row, meta + NT + i * FIELDS, pid - tl.load(meta + i)


def _gather_bands(src, out, meta, row0, T, k, NT: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """A block of output row ``row0 + pid1`` in tensor ``i``'s band.

    ``meta``: ``NT`` band block starts, then per tensor (delta, n, w, col)."""
    row, m, blk = _band_block(meta, row0, NT, 4)
    delta = tl.multiple_of(tl.load(m), VEC)
    n = tl.multiple_of(tl.load(m + 1), VEC)
    w = tl.multiple_of(tl.load(m + 2), VEC)
    col = tl.multiple_of(tl.load(m + 3), VEC)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    lead, j = row // k, row % k
    p = j * w + offs
    inside = offs < w
    x = tl.load(src + delta + lead * n + p, mask=inside & (p < n), other=0)
    tl.store(out + row * T + col + offs, x.to(out.dtype.element_ty), mask=inside)


def _scatter_bands(src, dst, meta, row0, S, NT: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """A block of piece ``i`` from input row ``row0 + pid1``.

    ``meta``: ``NT`` band block starts, then per piece (delta of its buffer, width, column)."""
    row, m, blk = _band_block(meta, row0, NT, 3)
    delta = tl.multiple_of(tl.load(m), VEC)
    w = tl.multiple_of(tl.load(m + 1), VEC)
    col = tl.multiple_of(tl.load(m + 2), VEC)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < w
    x = tl.load(src + row * S + col + offs, mask=inside)
    tl.store(dst + delta + row * w + offs, x, mask=inside)


if triton is not None:
    _band_block = triton.jit(_band_block)
    _gather_bands = triton.jit(_gather_bands)
    _scatter_bands = triton.jit(_scatter_bands)


class _Bands(NamedTuple):
    """The address-free part of a call's table: computed once per layout."""

    rows: int                # output rows (chunk_cat) or input rows (split)
    ns: Tuple[int, ...]      # elements per lead row of each input (chunk_cat)
    widths: Tuple[int, ...]
    cols: Tuple[int, ...]
    starts: Tuple[int, ...]  # band block starts, padded to a power of two
    blocks: int
    block: int
    vec: int                 # elements per 16-byte access if every n, width and column allows, else 1


_LAYOUTS: Dict[tuple, _Bands] = {}
_META: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_MAX_LAYOUTS, _MAX_META = 256, 64


def _bands(key: tuple, rows: int, ns: Sequence[int], widths: Sequence[int], cols: Sequence[int], vec: int) -> _Bands:
    """The layout's band table (cached under ``key``)."""
    block = 2048 if sum(widths) >= 2048 * len(widths) else 512
    starts, total = [], 0
    for w in widths:
        starts.append(total)
        total += -(-w // block)
    nt = 1 << max(0, (len(starts) - 1).bit_length())
    starts += [1 << 62] * (nt - len(starts))
    if any(v % vec for v in (*ns, *widths, *cols, sum(widths))):
        vec = 1
    if len(_LAYOUTS) >= _MAX_LAYOUTS:
        _LAYOUTS.clear()
    out = _LAYOUTS[key] = _Bands(rows, tuple(ns), tuple(widths), tuple(cols), tuple(starts), total, block, vec)
    return out


def _meta(key: tuple, bands: _Bands, fields: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """The table (block starts, then ``fields`` row by row) on ``device``, cached per (layout,
    addresses, stream) and sent from pinned memory without a host sync."""
    full = (key, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    hit = _META.get(full)
    if hit is not None:
        _META.move_to_end(full)
        return hit
    host = torch.tensor(list(bands.starts) + [v for row in zip(*fields) for v in row], dtype=torch.int64)
    meta = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    _META[full] = meta
    if len(_META) > _MAX_META:
        _META.popitem(last=False)
    return meta


def _deltas(tensors: Sequence[torch.Tensor]) -> List[int]:
    """Element offsets of each tensor's first element from the first tensor's."""
    size = tensors[0].element_size()
    base = tensors[0].data_ptr()
    out = []
    for t in tensors:
        diff = t.data_ptr() - base
        if diff % size:
            raise RuntimeError("misaligned tensor for the Triton copy kernel")  # never for torch allocations
        out.append(diff // size)
    return out


def _vec(bands: _Bands, deltas: Sequence[int], a: torch.Tensor, b: torch.Tensor) -> int:
    """``bands.vec`` where the addresses allow 16-byte accesses too, else 1."""
    v = bands.vec
    if v > 1 and all(x % v == 0 for x in deltas) and a.data_ptr() % (v * a.element_size()) == 0 \
            and b.data_ptr() % (v * b.element_size()) == 0:
        return v
    return 1


def _launch(kernel: Any, bands: _Bands, args: tuple, meta: torch.Tensor, tail: tuple, vec: int) -> None:
    """Launch over the rows, in slices of at most ``MAX_ROWS``."""
    nt = len(bands.starts)
    for row0 in range(0, bands.rows, MAX_ROWS):
        n = min(MAX_ROWS, bands.rows - row0)
        kernel[(bands.blocks, n)](*args, meta, row0, *tail, NT=nt, VEC=vec, BLOCK=bands.block)


def _vector(*tensors: torch.Tensor) -> int:
    """Elements per 16-byte access of the widest dtype among ``tensors``."""
    return max(1, 16 // max(t.element_size() for t in tensors))


def chunk_cat(tensors: Sequence[torch.Tensor], d: int, k: int, out: torch.Tensor) -> None:
    """Write ``chunk_cat(tensors, d, k)`` into the contiguous ``out`` (checks already done) in one launch."""
    srcs = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    key = ("cc", d, k, srcs[0].dtype, out.dtype, *(t.shape for t in srcs))
    bands = _LAYOUTS.get(key)
    if bands is None:
        lead = math.prod(srcs[0].shape[:d])
        ns = [t.numel() // lead for t in srcs]
        ws = [-(-t.shape[d] // k) * (n // t.shape[d]) for t, n in zip(srcs, ns)]
        bands = _bands(key, lead * k, ns, ws, [sum(ws[:i]) for i in range(len(ws))], _vector(srcs[0], out))
    deltas = _deltas(srcs)
    meta = _meta((key, srcs[0].data_ptr(), *deltas), bands, (deltas, bands.ns, bands.widths, bands.cols), out.device)
    _launch(_gather_bands, bands, (srcs[0], out), meta, (sum(bands.widths), k), _vec(bands, deltas, srcs[0], out))


def split_with_sizes_copy(tensor: torch.Tensor, d: int, sizes: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    """Copy the pieces of ``tensor`` along ``d`` into the contiguous ``outs`` (sized, checked) in one launch."""
    src = tensor if tensor.is_contiguous() else tensor.contiguous()
    dsts = [o for o, s in zip(outs, sizes) if s]
    if not dsts or src.numel() == 0:
        return
    key = ("split", d, src.dtype, tuple(sizes), *src.shape)
    bands = _LAYOUTS.get(key)
    if bands is None:
        lead = math.prod(src.shape[:d])
        r = math.prod(src.shape[d + 1:])
        ws, cols, acc = [], [], 0
        for s in sizes:
            if s:
                ws.append(s * r)
                cols.append(acc)
            acc += s * r
        bands = _bands(key, lead, (), ws, cols, _vector(src))
    deltas = _deltas(dsts)
    meta = _meta((key, dsts[0].data_ptr(), *deltas), bands, (deltas, bands.widths, bands.cols), src.device)
    _launch(_scatter_bands, bands, (src, dsts[0]), meta, (src.numel() // bands.rows,), _vec(bands, deltas, src, dsts[0]))
