"""Moving a tensor between two meshes: a plan of point-to-point boxes.

The source mesh and the destination mesh may differ in shape, in rank set, or both (disjoint,
overlapping or equal rank sets).  Every rank knows, from the two specs alone, which boxes of the
global tensor each source rank holds and which boxes each destination rank needs
(``placement.local_blocks``: uneven, nested and strided shards included), so the plan is a pure
function of (shape, itemsize, both meshes, both placements), the same on every rank without a
message, and cached.

* **Classes.** Source ranks that hold the same boxes (they differ only on replicated mesh dims)
  form a class; the classes partition the tensor.
* **Needs.** A destination rank needs its boxes; where it holds a part already (it is a source
  rank of the class), that part is copied locally (zero bytes).  Everything else it lacks is
  sent to it exactly once, by one holder of the class: the total bytes equal the lower bound.
* **Balance.** Within a class, the bytes it must send are laid end to end (receiver by
  receiver) and cut into ``k`` equal runs, one per holder (cuts fall inside a box at any
  element, ``split_box``): the busiest sender sends at most one element more than the balanced
  optimum ``bytes / k``.
* **Partial sources** either send their terms (each term a class of its own; receivers combine
  them in term order) or are reduced on the source mesh first (to Replicate or a Shard), then
  moved: whichever the alpha-beta model prices cheaper.
* **Partial destinations**: for ``sum`` / ``product`` the first rank along the Partial mesh
  dims receives the value and the others start from the identity (0 / 1); for ``avg``,
  ``max`` and ``min`` every rank receives the value.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Sequence

from ..placement import (Placement, Replicate, Shard, ShardOrder, all_planned, default_shard_order, display,
                         local_blocks, local_shape_and_offset, partial_op)
from .cost import DEFAULT_LINK, LinkModel, plan_cost
from .exchange import overlap
from .planner import plan
from .steps import Step

__all__ = ["Side", "Piece", "CrossPlan", "cross_plan", "clear_cache", "split_box"]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(global offsets, sizes)`` of a box of the global tensor."""


@dataclass(frozen=True)
class Side:
    """One side of a move: a mesh's ranks (row-major), its shape, the placements and shard order."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    order: ShardOrder

    def coords(self) -> dict[int, tuple[int, ...]]:
        return dict(zip(self.ranks, itertools.product(*(range(n) for n in self.shape))))

    def __str__(self) -> str:
        return f"mesh {list(self.ranks)} {self.shape} {display(self.placements, self.order)}"


@dataclass(frozen=True)
class Piece:
    """One box moved from ``src`` to ``dst`` (a local copy when they are the same rank)."""

    src: int
    dst: int
    offset: tuple[int, ...]
    size: tuple[int, ...]
    src_at: tuple[int, ...]
    """The box's offset in the sender's local tensor."""
    dst_at: tuple[int, ...]
    """The box's offset in the receiver's local tensor."""
    term: int = -1
    """Which term of a Partial source this is (row-major over its Partial mesh dims), or -1."""

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def split(self, n: int) -> tuple[list["Piece"], list["Piece"]]:
        """This piece's first ``n`` elements in row-major order as pieces, and the rest as pieces."""
        head, tail = split_box(self.offset, self.size, n)
        return [self._part(*b) for b in head], [self._part(*b) for b in tail]

    def _part(self, offset: tuple[int, ...], size: tuple[int, ...]) -> "Piece":
        def at(base: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(a + x - o for a, x, o in zip(base, offset, self.offset))

        return Piece(self.src, self.dst, offset, size, at(self.src_at), at(self.dst_at), self.term)


@dataclass(frozen=True)
class CrossPlan:
    """What every rank does to move one tensor between two meshes."""

    shape: tuple[int, ...]
    itemsize: int
    src: Side
    dst: Side
    pre: tuple[Placement, ...] | None
    """Placements the source is first redistributed to on its own mesh (reducing its Partials)."""
    pre_order: ShardOrder
    """Their shard order."""
    pieces: tuple[Piece, ...]
    fill: tuple[tuple[int, str], ...]
    """Destination ranks that hold the reduce op's identity, not the value (Partial destinations)."""
    optimum: float
    """The balanced busiest sender's bytes: per class, the bytes it must send over its holders."""
    reduce: str | None = None
    """The reduce op of a Partial source whose terms are sent and combined by the receivers."""
    terms: int = 1
    """How many terms each destination element combines (1 unless ``reduce``)."""

    def sent(self, rank: int) -> int:
        return sum(p.numel for p in self.pieces if p.src == rank and p.dst != rank) * self.itemsize

    def received(self, rank: int) -> int:
        return sum(p.numel for p in self.pieces if p.dst == rank and p.src != rank) * self.itemsize

    @property
    def total_bytes(self) -> int:
        return sum(p.numel for p in self.pieces if p.src != p.dst) * self.itemsize

    @property
    def busiest_sender(self) -> int:
        ranks = {p.src for p in self.pieces}
        return max((self.sent(r) for r in ranks), default=0)

    def describe(self) -> str:
        """A few lines: the sides, the pre-reduction, bytes per rank and the lower bound."""
        lines = [f"move {self.shape} ({self.itemsize} B/elem) from {self.src} to {self.dst}"]
        if self.pre is not None:
            lines.append(f"  first on the source mesh: reduce the Partials to {display(self.pre)}")
        if self.reduce is not None:
            lines.append(f"  the {self.terms} terms of every element are sent; receivers combine them ({self.reduce})")
        ranks = sorted(set(self.src.ranks) | set(self.dst.ranks))
        for r in ranks:
            copied = sum(p.numel for p in self.pieces if p.src == r == p.dst) * self.itemsize
            peers = sorted({p.dst for p in self.pieces if p.src == r and p.dst != r})
            lines.append(f"  rank {r}: sends {self.sent(r)} B to {peers}, receives {self.received(r)} B, "
                         f"copies {copied} B locally")
        lines.append(f"  total {self.total_bytes} B on the wire (= the lower bound: every byte a destination rank "
                     f"lacks, received once); busiest sender {self.busiest_sender} B, balanced optimum "
                     f"{self.optimum:.0f} B")
        return "\n".join(lines)


def _identity_fill(dst: Side) -> tuple[tuple[Placement, ...], dict[int, str]]:
    """Destination placements as the needs see them, and the ranks that start from an identity."""
    ops = {op for p in dst.placements if (op := partial_op(p)) is not None and op in ("sum", "product")}
    if len(ops) > 1:
        raise ValueError(f"destination placements {display(dst.placements)} mix Partial(sum) and Partial(product); "
                         "move to one of them, then redistribute on the destination mesh")
    dims = [j for j, p in enumerate(dst.placements) if partial_op(p) in ops]
    fill = {r: next(iter(ops)) for r, c in dst.coords().items() if any(c[j] for j in dims)}
    return tuple(Replicate() if p.is_partial() else p for p in dst.placements), fill


def _blocks(shape: tuple[int, ...], side: Side, placements: Sequence[Placement]
            ) -> dict[int, list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]]:
    return {r: local_blocks(shape, side.shape, c, placements, side.order) for r, c in side.coords().items()}


def split_box(off: tuple[int, ...], size: tuple[int, ...], n: int) -> tuple[list[Box], list[Box]]:
    """The box's first ``n`` elements in row-major order as boxes, and the rest as boxes (at most
    ``ndim`` boxes each)."""
    total = math.prod(size)
    if n <= 0:
        return [], [(off, size)]
    if n >= total:
        return [(off, size)], []
    inner = total // size[0]
    q, r = divmod(n, inner)
    head: list[Box] = [(off, (q,) + size[1:])] if q else []
    tail: list[Box] = []
    rest = q
    if r:
        h, t = split_box(off[1:], size[1:], r)
        head += [((off[0] + q,) + o, (1,) + s) for o, s in h]
        tail += [((off[0] + q,) + o, (1,) + s) for o, s in t]
        rest = q + 1
    if rest < size[0]:
        tail.append(((off[0] + rest,) + off[1:], (size[0] - rest,) + size[1:]))
    return head, tail


def _pieces(shape: tuple[int, ...], src: Side, dst: Side, need: dict, fill: dict[int, str]
            ) -> tuple[list[Piece], float]:
    """The pieces of a move, term 0 first, and the balanced optimum (elements).  A source's Partial
    mesh dims number its terms: each term is a class of its own, every destination needs them all.
    ``need``: every destination rank's blocks; ``fill``: the ranks that need none."""
    pdims = [j for j, p in enumerate(src.placements) if p.is_partial()]
    held = _blocks(shape, src, [Replicate() if p.is_partial() else p for p in src.placements])
    coords = src.coords()
    classes: dict[tuple[int, tuple], list[int]] = {}
    for r in src.ranks:
        boxes = tuple((o, s) for s, o, _ in held[r])
        if boxes:
            term = 0
            for j in pdims:
                term = term * src.shape[j] + coords[r][j]
            classes.setdefault((term, boxes), []).append(r)
    local: list[Piece] = []
    streams: dict[tuple[int, tuple], list[Piece]] = {}
    for key, holders in classes.items():
        blocks = held[holders[0]]
        for d in dst.ranks:
            if d in fill:
                continue
            for dsize, doff, dat in need[d]:
                for ssize, soff, sat in blocks:
                    o = overlap((doff, dsize), (soff, ssize))
                    if o is None:
                        continue
                    p = Piece(d, d, o[0], o[1], tuple(a + x - g for a, x, g in zip(sat, o[0], soff)),
                              tuple(a + x - g for a, x, g in zip(dat, o[0], doff)), key[0] if pdims else -1)
                    (local if d in holders else streams.setdefault(key, [])).append(p)
    sent: list[Piece] = []
    optimum = 0.0
    for key, items in streams.items():
        holders = classes[key]
        sent += _balance(items, holders)
        optimum = max(optimum, sum(p.numel for p in items) / len(holders))
    return sorted(local + sent, key=lambda p: p.term), optimum


def _balance(items: list[Piece], holders: list[int]) -> list[Piece]:
    """Cut the class's stream of pieces into ``len(holders)`` runs of equal element counts, one
    run sent by each holder."""
    total = sum(p.numel for p in items)
    k = len(holders)
    cuts = [total * (i + 1) // k for i in range(k)]
    out: list[Piece] = []
    h, pos = 0, 0
    for item in items:
        rest = [item]
        while rest:
            p = rest.pop(0)
            while pos >= cuts[h]:
                h += 1
            take = min(p.numel, cuts[h] - pos)
            head, tail = p.split(take)
            out += [replace(q, src=holders[h]) for q in head]
            pos += take
            rest = tail + rest
    return out


def _move_seconds(pieces: Sequence[Piece], itemsize: int, link: LinkModel) -> float:
    """Modeled time of the point-to-point stage: the busiest rank's messages and bytes."""
    per: dict[int, list[int]] = {}
    pairs = {(p.src, p.dst) for p in pieces if p.src != p.dst}
    for p in pieces:
        if p.src != p.dst:
            per.setdefault(p.src, [0, 0])[0] += p.numel * itemsize
            per.setdefault(p.dst, [0, 0])[1] += p.numel * itemsize
    if not per:
        return 0.0
    msgs = {r: sum(1 for a, b in pairs if r in (a, b)) for r in per}
    return link.launch + max(msgs[r] * link.alpha + max(b) * link.beta for r, b in per.items())


def _reductions(src: Side, ndim: int) -> list[tuple[tuple[Placement, ...], ShardOrder]]:
    """Candidate placements (and shard orders) that reduce the source's Partials on its own mesh:
    Replicate (an all-reduce) keeping the source's order, or, where the planner moves every
    placement of the source, a Shard of one dim (a reduce-scatter)."""
    out = [(tuple(Replicate() if p.is_partial() else p for p in src.placements), src.order)]
    if all_planned(src.placements) and src.order == default_shard_order(src.placements):
        for d in range(ndim):
            pl = tuple(Shard(d) if p.is_partial() else p for p in src.placements)
            out.append((pl, default_shard_order(pl)))
    return out


@lru_cache(maxsize=1024)
def cross_plan(shape: tuple[int, ...], itemsize: int, src: Side, dst: Side) -> CrossPlan:
    """The plan of a move (cached): pieces, the pre-reduction of Partial sources, fills.

    A Partial source is either reduced on its mesh first (to Replicate or a Shard) or its terms
    are sent and combined by the receivers: whichever the alpha-beta model prices cheapest, or on
    one mesh (a redistribution), whichever moves the fewest bytes to the busiest rank."""
    dst_pl, fills = _identity_fill(dst)
    need, fill = _blocks(shape, dst, dst_pl), tuple(sorted(fills.items()))
    ops = {op for p in src.placements if (op := partial_op(p)) is not None}
    if not ops:
        pieces, optimum = _pieces(shape, src, dst, need, fills)
        return CrossPlan(shape, itemsize, src, dst, None, (), tuple(pieces), fill, optimum * itemsize)
    same = src.ranks == dst.ranks and src.shape == dst.shape  # a redistribution on one mesh: fewest bytes first
    best: tuple[float, float, CrossPlan] | None = None
    if len(ops) == 1 and all(p.plain_op() for p in src.placements if p.is_partial()):
        pieces, optimum = _pieces(shape, src, dst, need, fills)
        terms = math.prod(n for n, p in zip(src.shape, src.placements) if p.is_partial())
        cand = CrossPlan(shape, itemsize, src, dst, None, (), tuple(pieces), fill, optimum * itemsize,
                         next(iter(ops)), terms)
        seconds = _move_seconds(pieces, itemsize, DEFAULT_LINK)
        best = (_busiest(cand), seconds, cand) if same else (seconds, cand.total_bytes, cand)
    for pre, order in _reductions(src, len(shape)):
        try:
            cost = _reduce_cost(src, pre, order, shape, itemsize)
        except ValueError:
            continue
        pieces, optimum = _pieces(shape, Side(src.ranks, src.shape, pre, order), dst, need, fills)
        cand = CrossPlan(shape, itemsize, src, dst, pre, order, tuple(pieces), fill, optimum * itemsize)
        seconds = cost[1] + _move_seconds(pieces, itemsize, DEFAULT_LINK)
        key = (cost[0] + _busiest(cand), seconds) if same else (seconds, cand.total_bytes)
        if best is None or key < best[:2]:
            best = (*key, cand)
    assert best is not None  # Replicate is always a valid reduction
    return best[2]


def _busiest(p: CrossPlan) -> int:
    """The most bytes any rank receives in the point-to-point stage."""
    return max((p.received(r) for r in p.dst.ranks), default=0)


def _reduce_cost(src: Side, pre: tuple[Placement, ...], order: ShardOrder, shape: tuple[int, ...],
                 itemsize: int) -> tuple[float, float]:
    """``(bytes per rank, seconds)`` of reducing the source's Partials to ``pre`` on its mesh: the
    planner's price where it moves every placement, else that of an all-reduce of each Partial mesh
    dim on the busiest rank's local tensor (the other placements stay as they are)."""
    if all_planned(src.placements):
        return plan_cost(plan(src.placements, src.order, pre, order, shape, src.shape, itemsize), shape, src.shape,
                         itemsize)
    local = max((local_shape_and_offset(shape, src.shape, c, pre, order)[0] for c in src.coords().values()),
                key=math.prod)
    state = tuple(p if p.is_partial() else Replicate() for p in src.placements)  # the local tensor, whole
    steps = [Step(j, p, Replicate(), state, ()) for j, p in enumerate(state) if p.is_partial()]
    return plan_cost(steps, local, src.shape, itemsize)


def clear_cache() -> None:
    cross_plan.cache_clear()
