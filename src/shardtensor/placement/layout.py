"""The arithmetic of local shapes, offsets and blocks, asked of the placements (``base.py``).

Pure: it maps (global shape, mesh shape, coordinate, placements, shard order) to the local shape
and global offset of a rank, following each placement's ``pieces`` (uneven and empty pieces are
legal) and nested sharding (several mesh dims splitting one tensor dim, in an explicit order).
"""
from __future__ import annotations

import itertools
from typing import Sequence

from .base import LAST, ORDERED, Placement, unfake
from .replicate import Replicate

ShardOrder = tuple[tuple[int, tuple[int, ...]], ...]
"""``((tensor_dim, (mesh_dim, ...)), ...)`` sorted by tensor dim, first-applied mesh dim first."""


def unpartial(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """Every Partial -> Replicate: the placements once the pending reductions are done."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def all_planned(placements: Sequence[Placement]) -> bool:
    """Whether the collective planner moves every one of ``placements``."""
    return all(p.planned for p in placements)


def rules_view(placements: Sequence[Placement], order: ShardOrder) -> tuple[tuple[Placement, ...], ShardOrder]:
    """What dispatch gathers an input to before a rule reads it: every placement the sharding
    rules do not read made ``Replicate``, and the shard order without its mesh dims."""
    pl = tuple(p if p.rules_read else Replicate() for p in placements)
    kept = tuple((d, js2) for d, js in order if (js2 := tuple(j for j in js if pl[j].nests == ORDERED)))
    return pl, kept


def normalize_placements(placements: Sequence[Placement], ndim: int, mesh_ndim: int,
                         mesh_shape: Sequence[int] | None = None) -> tuple[Placement, ...]:
    """Validate placements for a tensor of ``ndim`` dims on a mesh of ``mesh_ndim`` dims (of
    ``mesh_shape``, where known).  Negative dims are wrapped; out-of-range dims, wrong counts and
    non-placements raise."""
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise TypeError(f"placements must be a sequence of Placement, got {placements!r}")
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"got {len(placements)} placements {tuple(placements)} for a mesh with {mesh_ndim} dims; "
            "give exactly one placement per mesh dim"
        )
    out = []
    for j, p in enumerate(placements):
        p = unfake(p)
        if not isinstance(p, Placement):
            raise TypeError(f"placement must be Shard, Replicate or Partial, got {p!r}")
        out.append(p.normalized(ndim, None if mesh_shape is None else mesh_shape[j]))
    _check_last(out)
    return tuple(out)


def _check_last(placements: Sequence[Placement]) -> None:
    """A placement that splits its tensor dim last (``StridedShard``): one per dim, after every
    ordered split of it."""
    seen: set[int] = set()
    for j, p in enumerate(placements):
        if p.nests != LAST:
            continue
        d = p.tensor_dim()
        assert d is not None
        if d in seen:
            raise NotImplementedError(f"placements {tuple(placements)}: two {type(p).__name__} of tensor dim {d} (two "
                                      "placements that split it last)")
        seen.add(d)
        if any(q.nests == ORDERED and q.tensor_dim() == d for q in placements[j + 1:]):
            raise NotImplementedError(
                f"placements {tuple(placements)}: a shard of dim {d} after {p!r} (torch's right-to-left "
                "sharding) is written in shardtensor as Shard on both mesh dims with a shard_order that lists the "
                "later mesh dim first")


def default_shard_order(placements: Sequence[Placement]) -> ShardOrder:
    """Mesh dims left to right within each sharded tensor dim."""
    by_dim: dict[int, list[int]] = {}
    for j, p in enumerate(placements):
        if p.nests == ORDERED:
            by_dim.setdefault(p.tensor_dim(), []).append(j)  # type: ignore[arg-type]
    return tuple((d, tuple(js)) for d, js in sorted(by_dim.items()))


def validate_shard_order(placements: Sequence[Placement], order: ShardOrder) -> ShardOrder:
    """Check that ``order`` lists exactly the sharding mesh dims of each tensor dim."""
    def as_int(v: object) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"shard order {order!r}: dims must be ints, got {v!r}")
        return v

    entries = [(as_int(d), tuple(as_int(j) for j in js)) for d, js in order]
    dims = [d for d, _ in entries]
    if len(set(dims)) != len(dims):
        raise ValueError(f"shard order {order!r} lists a tensor dim twice; give one entry per sharded tensor dim")
    order = tuple(sorted(entries))
    seen: list[int] = []
    for d, js in order:
        if not js:
            raise ValueError(f"shard order {order}: tensor dim {d} has an empty mesh-dim list")
        for j in js:
            if not 0 <= j < len(placements) or placements[j].nests != ORDERED or placements[j].tensor_dim() != d:
                raise ValueError(f"shard order {order}: mesh dim {j} does not shard dim {d} in {tuple(placements)}")
            seen.append(j)
    expected = sorted(j for j, p in enumerate(placements) if p.nests == ORDERED)
    if sorted(seen) != expected:
        raise ValueError(f"shard order {order} does not list each sharding mesh dim of {tuple(placements)} once")
    return order


def execution_order(placements: Sequence[Placement], order: ShardOrder | None) -> list[int]:
    """Mesh dims that split in order, in the order they split (tensor dims are independent)."""
    if order is None:
        return [j for j, p in enumerate(placements) if p.nests == ORDERED]
    return [j for _, js in order for j in js]


def _ordered(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
             placements: Sequence[Placement], order: ShardOrder | None) -> tuple[list[int], list[int]]:
    """Sizes and offsets after the ordered splits (an empty piece's offset is the dim's length)."""
    shape = list(global_shape)
    offset = [0] * len(shape)
    for j in execution_order(placements, order):
        p = placements[j]
        d = p.tensor_dim()
        assert d is not None
        [(s, o)] = p.pieces(shape[d], mesh_shape[j], coordinate[j])
        shape[d] = s
        offset[d] = global_shape[d] if s == 0 else offset[d] + o
    return shape, offset


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int] | None,
    placements: Sequence[Placement],
    order: ShardOrder | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of the rank at ``coordinate`` (docs/placements.md).

    An empty piece reports the global length as its offset; a rank outside the mesh
    (``coordinate=None``) gets shape ``(0,)`` and an empty offset.  Where a placement holds
    several runs of a dim, the offset is its first element's.
    """
    if coordinate is None:
        return (0,), ()
    shape, offset = _ordered(global_shape, mesh_shape, coordinate, placements, order)
    for j, p in enumerate(placements):
        if p.nests == LAST:
            d = p.tensor_dim()
            assert d is not None
            if shape[d]:
                runs = [(s, o) for s, o in p.pieces(shape[d], mesh_shape[j], coordinate[j]) if s]
                shape[d] = sum(s for s, _ in runs)
                offset[d] = offset[d] + runs[0][1] if runs else global_shape[d]
    return tuple(shape), tuple(offset)


def local_blocks(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                 placements: Sequence[Placement], order: ShardOrder | None = None
                 ) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """The boxes of the global tensor that the rank at ``coordinate`` holds, none empty:
    ``(sizes, global offsets, offsets in its local tensor)``.  One box, or where a placement holds
    several runs of a dim, one per run (per combination, when several dims hold runs)."""
    sizes, offsets = _ordered(global_shape, mesh_shape, coordinate, placements, order)
    per_dim = [[(n, o, 0)] for n, o in zip(sizes, offsets)]
    for j, p in enumerate(placements):
        if p.nests == LAST:
            d = p.tensor_dim()
            assert d is not None
            runs, at = [], 0
            for n, o in p.pieces(sizes[d], mesh_shape[j], coordinate[j]):
                runs.append((n, offsets[d] + o, at))
                at += n
            per_dim[d] = runs
    return [(tuple(r[0] for r in combo), tuple(r[1] for r in combo), tuple(r[2] for r in combo))
            for combo in itertools.product(*per_dim) if all(r[0] for r in combo)]


def split_local(t, mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Placement],
                order: ShardOrder | None = None, ordered: bool = True):
    """The rank at ``coordinate``'s local tensor from ``t``, the whole value (or, with
    ``ordered=False``, its piece after the ordered splits): the ordered splits in order, then the
    last ones, then Partial terms.  No communication; may be a view of ``t``."""
    todo = execution_order(placements, order) if ordered else []
    todo += [j for j, p in enumerate(placements) if p.nests == LAST]
    todo += [j for j, p in enumerate(placements) if p.is_partial()]
    for j in todo:
        t = placements[j].split_value(t, mesh_shape[j], coordinate[j])
    return t


def compute_local_shape(global_shape, mesh_shape, coordinate, placements, order=None) -> tuple[int, ...]:
    return local_shape_and_offset(global_shape, mesh_shape, coordinate, placements, order)[0]


class OrderedPlacements(tuple):
    """A DTensor's placements when its nested shard order is not the default one.

    Equal to (and hashes as) the plain tuple, so comparisons with ``(Shard(0), Shard(0))`` hold;
    its repr marks each mesh dim's position in its tensor dim's split order
    (``(Shard(dim=0)[1], Shard(dim=0)[0])``: mesh dim 1 splits dim 0 first), and passing it back
    as ``placements=`` (to ``redistribute``, ``from_local``, ``distribute_tensor``) keeps the order.
    """

    __module__ = "shardtensor.placement"
    shard_order: ShardOrder

    def __new__(cls, placements: Sequence[Placement], shard_order: ShardOrder) -> "OrderedPlacements":
        out = super().__new__(cls, placements)
        out.shard_order = shard_order
        return out

    def __getnewargs__(self) -> tuple:  # type: ignore[override]
        return tuple(self), self.shard_order

    def __repr__(self) -> str:
        pos = {j: i for _, js in self.shard_order for i, j in enumerate(js) if len(js) > 1}
        return "(" + ", ".join(repr(p) + (f"[{pos[j]}]" if j in pos else "") for j, p in enumerate(self)) + ")"


def display(placements: Sequence[Placement], order: ShardOrder | None = None) -> str:
    """Compact form: ``S(0)[1]S(0)[0]`` marks each mesh dim's position in a nested tensor dim."""
    order = order if order is not None else default_shard_order(placements)
    pos = {j: (i, len(js)) for _, js in order for i, j in enumerate(js)}
    parts = []
    for j, p in enumerate(placements):
        s = str(p)
        if j in pos and pos[j][1] > 1:
            s += f"[{pos[j][0]}]"
        parts.append(s)
    return "(" + ", ".join(parts) + ")"
