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

Triton is optional (``pip install 'shardtensor[gpu]'``; it ships with CUDA builds of torch).
Under ``TRITON_INTERPRET=1`` (set before Triton is imported) the kernels run on CPU tensors in
Triton's interpreter, which is how the CPU test suite checks them.  ``supports`` says which
calls they take; the others keep the per-tensor path.
"""
import math
from typing import Any, List, Sequence, Tuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU kernels serve; see available()
    triton = None

BLOCK = 1024
MAX_ROWS = 65535  # CUDA's limit on the grid's second axis; taller outputs launch in row slices


_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
                     torch.int32, torch.int64, torch.uint8, torch.bool})


def available() -> bool:
    """True when Triton imports (it ships with CUDA builds of torch)."""
    return triton is not None


def supports(tensors: Sequence[torch.Tensor]) -> bool:
    """Dtypes Triton loads, without a conjugate or negative bit (Triton reads raw memory)."""
    return all(t.dtype in _DTYPES and not t.is_conj() and not t.is_neg() for t in tensors)


def _gather_bands(src, out, meta, starts, T, k, NT: tl.constexpr, BLOCK: tl.constexpr):
    """Output block of row ``meta[0] + pid1``: a block of tensor ``i``'s band (meta row i: delta, n, w, col)."""
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64) + tl.load(meta)
    i = tl.sum((tl.load(starts + tl.arange(0, NT)) <= pid).to(tl.int32)) - 1
    m = meta + 1 + i * 4
    delta, n, w, col = tl.load(m), tl.load(m + 1), tl.load(m + 2), tl.load(m + 3)
    offs = (pid - tl.load(starts + i)) * BLOCK + tl.arange(0, BLOCK)
    lead, j = row // k, row % k
    p = j * w + offs
    inside = offs < w
    x = tl.load(src + delta + lead * n + p, mask=inside & (p < n), other=0)
    tl.store(out + row * T + col + offs, x.to(out.dtype.element_ty), mask=inside)


def _scatter_bands(src, dst, meta, starts, S, NT: tl.constexpr, BLOCK: tl.constexpr):
    """Input row ``meta[0] + pid1``: a block of piece ``i`` (meta row i: delta of its buffer, width, column)."""
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64) + tl.load(meta)
    i = tl.sum((tl.load(starts + tl.arange(0, NT)) <= pid).to(tl.int32)) - 1
    m = meta + 1 + i * 3
    delta, w, col = tl.load(m), tl.load(m + 1), tl.load(m + 2)
    offs = (pid - tl.load(starts + i)) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < w
    x = tl.load(src + row * S + col + offs, mask=inside)
    tl.store(dst + delta + row * w + offs, x, mask=inside)


if triton is not None:
    _gather_bands = triton.jit(_gather_bands)
    _scatter_bands = triton.jit(_scatter_bands)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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


def _block_starts(widths: Sequence[int], device: torch.device) -> Tuple[torch.Tensor, int, int]:
    """Prefix sums of each band's block count (padded to a power of two); total blocks; padded size."""
    starts, total = [], 0
    for w in widths:
        starts.append(total)
        total += -(-w // BLOCK)
    nt = _pow2(len(starts))
    starts += [1 << 62] * (nt - len(starts))
    return torch.tensor(starts, dtype=torch.int64, device=device), total, nt


def _launch(kernel: Any, rows: int, blocks: int, meta_rows: List[int], args_before: tuple, args_after: tuple,
            device: torch.device) -> None:
    """Launch over ``rows`` rows, in slices of at most ``MAX_ROWS`` (meta[0] is the slice's first row)."""
    for row0 in range(0, rows, MAX_ROWS):
        meta = torch.tensor([row0] + meta_rows, dtype=torch.int64, device=device)
        n = min(MAX_ROWS, rows - row0)
        kernel[(blocks, n)](*args_before, meta, *args_after, BLOCK=BLOCK)


def chunk_cat(tensors: Sequence[torch.Tensor], d: int, k: int, out: torch.Tensor) -> None:
    """Write ``chunk_cat(tensors, d, k)`` into the contiguous ``out`` (checks already done) in one launch."""
    srcs = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    lead = math.prod(srcs[0].shape[:d])
    ns = [t.numel() // lead for t in srcs]
    ws = [-(-t.shape[d] // k) * (n // t.shape[d]) for t, n in zip(srcs, ns)]
    total = sum(ws)
    cols = [sum(ws[:i]) for i in range(len(ws))]
    starts, blocks, nt = _block_starts(ws, out.device)
    meta = [v for row in zip(_deltas(srcs), ns, ws, cols) for v in row]
    _launch(_gather_bands, lead * k, blocks, meta, (srcs[0], out), (starts, total, k, nt), out.device)


def split_with_sizes_copy(tensor: torch.Tensor, d: int, sizes: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    """Copy the pieces of ``tensor`` along ``d`` into the contiguous ``outs`` (sized, checked) in one launch."""
    src = tensor if tensor.is_contiguous() else tensor.contiguous()
    lead = math.prod(src.shape[:d])
    r = math.prod(src.shape[d + 1:])
    keep = [(o, s * r) for o, s in zip(outs, sizes) if s]
    if not keep or lead == 0:
        return
    ws = [w for _, w in keep]
    cols, acc = [], 0
    for s in sizes:
        if s:
            cols.append(acc)
        acc += s * r
    starts, blocks, nt = _block_starts(ws, src.device)
    dsts = [o for o, _ in keep]
    meta = [v for row in zip(_deltas(dsts), ws, cols) for v in row]
    _launch(_scatter_bands, lead, blocks, meta, (src, dsts[0]), (starts, src.shape[d] * r, nt), src.device)
