"""The global metadata of per-rank pieces: what ``DTensor.from_local`` checks and derives.

Each rank holds one piece.  The global shape comes from ``shape=``, from the pieces' sizes
(gathered in one small all-gather when a dim is sharded), or from the even assumption.  The
global stride follows the pieces' memory layout: dense, with the dims ordered as the local
strides order them (a permuted piece gives a permuted global tensor, as in torch).  When the
pieces are gathered, every rank checks every piece the same way, so a bad piece raises the
same ``ValueError`` on every rank, naming the field and the ranks.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from . import comm
from .mesh import DeviceMesh
from .placement import Placement, display, local_shape_and_offset

__all__ = ["check_shape", "check_pieces", "layout_stride", "with_strides"]

# every torch dtype, numbered the same way in every process running this torch (no first-seen order)
_DTYPE_CODES: dict[torch.dtype, int] = {d: i for i, d in enumerate(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))}

META_DIMS = 64
"""Local shapes and strides are gathered padded to this many dims, so ranks of any ndim meet."""


def check_shape(shape: Any, local: torch.Tensor) -> tuple[int, ...]:
    """``from_local``'s ``shape=``: a sequence of non-negative ints, one per dim of the local tensor."""
    if not isinstance(shape, (tuple, list, torch.Size)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"from_local: shape must be a sequence of non-negative ints, got {shape!r}")
    if len(shape) != local.ndim:
        raise ValueError(f"from_local: shape {tuple(shape)} has {len(shape)} dims, local tensor "
                         f"{tuple(local.shape)} has {local.ndim}")
    return tuple(shape)


def _order(shape: Sequence[int], stride: Sequence[int], dims: Sequence[int]) -> list[int]:
    """``dims`` from outermost to innermost in memory (larger stride first, ties by dim)."""
    return sorted(dims, key=lambda d: (-stride[d], d))


def layout_stride(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Dense strides of ``shape`` with the dims laid out in ``order`` (outermost first)."""
    stride = [0] * len(shape)
    step = 1
    for d in reversed(order):
        stride[d] = step
        step *= max(shape[d], 1)
    return tuple(stride)


def local_order(local: torch.Tensor) -> list[int]:
    return _order(local.shape, local.stride(), range(local.ndim))


def _gather_meta(local: torch.Tensor, mesh: DeviceMesh) -> list[dict[str, Any]]:
    """ndim, dtype, requires_grad, shape and stride of every rank's piece, in group-rank order: one
    all-gather of a fixed-width row, so ranks that disagree on ndim still meet in the same collective.
    The row is plain ints, so the collective runs now (``issue``), even while torch.compile traces
    ``local`` (see ``check_pieces``)."""
    n = min(local.ndim, META_DIMS)
    pad = [0] * (META_DIMS - n)
    row = ([local.ndim, _DTYPE_CODES[local.dtype], int(local.requires_grad)]
           + [int(k) for k in local.shape[:n]] + pad + [int(k) for k in local.stride()[:n]] + pad)
    meta = torch.tensor(row, dtype=torch.int64, device=local.device)
    rows = comm.issue("all_gather", mesh.group_ranks(None), None, meta).reshape(-1, 3 + 2 * META_DIMS).tolist()
    out = []
    for r in rows:
        k = min(r[0], META_DIMS)
        out.append({"ndim": r[0], "dtype": r[1], "requires_grad": bool(r[2]), "shape": r[3:3 + k],
                    "stride": r[3 + META_DIMS:3 + META_DIMS + k]})
    return out


def _same(field: str, values: list[Any], ranks: Sequence[int], show: Any = str) -> None:
    if len(set(values)) != 1:
        raise ValueError(f"from_local: every rank's piece must have the same {field}; got "
                         + ", ".join(f"rank {r}: {show(v)}" for r, v in zip(ranks, values)))


def check_pieces(local: torch.Tensor, mesh: DeviceMesh, pl: tuple[Placement, ...],
                 shape: tuple[int, ...] | None) -> tuple[tuple[int, ...], list[int]]:
    """Gather every rank's piece metadata; all ranks raise the same error on a mismatch.

    Returns the global shape (``shape`` when given, else the one the pieces' sizes add up to)
    and the global dim order (outermost first) the pieces' strides agree on.  When torch.compile
    traces ``local`` (fake, with this rank's real sizes, each guarded), the metadata is exchanged
    then, eagerly, and the global shape becomes a constant of the graph."""
    if not comm.tracing(local):
        return _check_pieces(local, mesh, pl, shape)
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # fake tensors, tracing and functionalization: real ints, a real collective
        return _check_pieces(local, mesh, pl, shape)


def _check_pieces(local: torch.Tensor, mesh: DeviceMesh, pl: tuple[Placement, ...],
                  shape: tuple[int, ...] | None) -> tuple[tuple[int, ...], list[int]]:
    meta = _gather_meta(local, mesh)
    ranks = mesh.group_ranks(None)
    _same("ndim", [m["ndim"] for m in meta], ranks)
    if meta[0]["ndim"] > META_DIMS:
        raise NotImplementedError(f"from_local: checking pieces of more than {META_DIMS} dims; pass shape= and "
                                  "run_check=False")
    names = {v: k for k, v in _DTYPE_CODES.items()}
    _same("dtype", [m["dtype"] for m in meta], ranks, lambda c: names.get(c, c))
    _same("requires_grad", [m["requires_grad"] for m in meta], ranks)
    shapes = [m["shape"] for m in meta]
    coords = [tuple((mesh.mesh == r).nonzero()[0].tolist()) for r in ranks]
    if shape is None:
        shape = tuple(_summed_size(d, shapes, coords, mesh, pl) for d in range(local.ndim))
    bad = []
    for r, c, s in zip(ranks, coords, shapes):
        want = local_shape_and_offset(shape, mesh.shape, c, pl)[0]
        if tuple(s) != tuple(want):
            bad.append(f"rank {r}: local {tuple(s)}, expected {tuple(want)}")
    if bad:
        raise ValueError(f"from_local: local shapes disagree with global shape {tuple(shape)} "
                         f"and placements {display(pl)}: " + "; ".join(bad)
                         + ". Each piece must be the one its placements give that rank (a Shard(d): torch.chunk's split)")
    return shape, _common_order(meta, ranks)


def _common_order(meta: list[dict[str, Any]], ranks: Sequence[int]) -> list[int]:
    """The dim order every piece's strides agree on (dims of local size <= 1 order nothing)."""
    big = [[d for d, n in enumerate(m["shape"]) if n > 1] for m in meta]
    ref = max(range(len(meta)), key=lambda i: (len(big[i]), -i))
    order = _order(meta[ref]["shape"], meta[ref]["stride"], range(meta[ref]["ndim"]))
    orders = [tuple(_order(m["shape"], m["stride"], b)) for m, b in zip(meta, big)]
    if any(o != tuple(d for d in order if d in b) for o, b in zip(orders, big)):
        raise ValueError("from_local: every rank's piece must have the same memory layout (stride order); got "
                         + ", ".join(f"rank {r}: shape {tuple(m['shape'])} stride {tuple(m['stride'])}"
                                     for r, m in zip(ranks, meta)) + ". Make the pieces .contiguous() first")
    return order


def _summed_size(d: int, shapes: list[list[int]], coords: list[tuple[int, ...]], mesh: DeviceMesh,
                 pl: tuple[Placement, ...]) -> int:
    """Global size of dim ``d``: the pieces' sizes along the mesh dims sharding it, else rank 0's size."""
    mesh_dims = [j for j, p in enumerate(pl) if p.tensor_dim() == d]
    if not mesh_dims:
        return shapes[0][d]
    return sum(s[d] for s, c in zip(shapes, coords)
               if all(c[j] == 0 for j in range(mesh.ndim) if j not in mesh_dims))


def with_strides(t: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """``t`` copied into the layout ``stride`` when it differs and is dense (a layout that
    overlaps or has gaps cannot hold one copy of each element, so ``t`` stays as it is)."""
    if tuple(t.stride()) == stride or t.numel() == 0:
        return t
    expected = 1
    for st, n in sorted((st, n) for n, st in zip(shape, stride) if n != 1):
        if st != expected:
            return t
        expected *= n
    out = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t)
    return out


def check_partial_dtype(placements: Any, dtype: torch.dtype) -> None:
    """A ``Partial(max|min)`` of complex values has no meaning (they are not ordered): say so."""
    if dtype.is_complex:
        for p in placements:
            if getattr(p, "reduce_op", None) in ("max", "min") and p.is_partial():
                raise TypeError(f"from_local: placements hold {p!r}, which needs ordered values, but the local "
                                f"tensor is {dtype} (complex numbers have no max or min); use Partial('sum') or "
                                f"Partial('avg'), or reduce abs() values")
