"""A simple, always-correct planner: undo what must change, then build the target.

A plan is a tuple of steps; each changes the placement of one mesh dim.  The steps depend
only on (source placements+order, target placements+order), never on the rank, so every
rank runs the same collectives in the same order.  The executor derives each step's
logical shape from the recorded state before the step.

Phases: (1) pop, last-applied first, every mesh dim that shards a tensor dim beyond the
prefix shared with the target order -- straight to its target shard by all-to-all when it
lands in place, else to Replicate; (2) append the target shards in target order (chunk from
Replicate, reduce-scatter from Partial); (3) reduce the remaining partials; (4) partition.
The executor uses the byte-optimal planner (``optimal.py``); this one is the correctness
baseline it is tested against, its fallback, and ``PLANNER = "simple"`` in ``execute.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..placement import Partial, Placement, Replicate, Shard, ShardOrder


@dataclass(frozen=True)
class Step:
    """Change mesh dim ``mesh_dim`` from ``src`` to ``dst`` in state ``(placements, order)``."""

    mesh_dim: int
    src: Placement
    dst: Placement
    placements: tuple[Placement, ...]
    order: ShardOrder

    @property
    def collective(self) -> str:
        return transition_kind(self.src, self.dst)

    @property
    def mesh_dims(self) -> tuple[int, ...]:
        """The mesh dims the step's collective spans (one for a plain step)."""
        return (self.mesh_dim,)


@dataclass(frozen=True)
class FlatStep(Step):
    """One collective over the flattened group of several mesh dims, all going ``src -> dst``.

    ``dims`` lists the mesh dims major first: the group rank is the row-major index of the
    coordinates on ``dims``.  For ``S(d) -> R`` they are the last entries of ``d``'s list in
    list order; for ``P -> S(d)`` they are appended to ``d``'s list in that order; for
    ``P -> R`` any order.  ``mesh_dim`` is ``dims[0]``.
    """

    dims: tuple[int, ...] = ()

    @property
    def mesh_dims(self) -> tuple[int, ...]:
        return self.dims


@dataclass(frozen=True)
class ExchangeStep(Step):
    """The whole change of ``dims`` (ascending) as one all-to-all over their flattened group:
    every rank sends each peer the part of its block that the peer's target block needs
    (``exchange.py``).  The state after it is ``(target, target_order)``."""

    dims: tuple[int, ...] = ()
    target: tuple[Placement, ...] = ()
    target_order: ShardOrder = ()

    @property
    def mesh_dims(self) -> tuple[int, ...]:
        return self.dims

    @property
    def collective(self) -> str:
        return "all_to_all"


def transition_kind(src: Placement, dst: Placement) -> str:
    """Name of the collective (or local op) a single-mesh-dim transition uses."""
    if src == dst:
        return "identity"
    if isinstance(src, Replicate):
        return "chunk" if isinstance(dst, Shard) else "partition"
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return "all_gather"
        return "all_to_all" if isinstance(dst, Shard) else "invalid"
    if isinstance(dst, Replicate):
        return "all_reduce"
    if isinstance(dst, Shard):
        return "reduce_scatter"
    return "rescale"


def _freeze(order: dict[int, list[int]]) -> ShardOrder:
    return tuple((d, tuple(js)) for d, js in sorted(order.items()) if js)


@lru_cache(maxsize=4096)
def plan(src: tuple[Placement, ...], src_order: ShardOrder, dst: tuple[Placement, ...], dst_order: ShardOrder) -> tuple[Step, ...]:
    """Steps from ``(src, src_order)`` to ``(dst, dst_order)`` (same mesh)."""
    cur = list(src)
    order = {d: list(js) for d, js in src_order}
    tgt = {d: list(js) for d, js in dst_order}
    steps: list[Step] = []

    def emit(j: int, new: Placement) -> None:
        steps.append(Step(j, cur[j], new, tuple(cur), _freeze(order)))
        cur[j] = new

    keep: dict[int, int] = {}
    for d in set(order) | set(tgt):
        a, b = order.get(d, []), tgt.get(d, [])
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        keep[d] = n

    while any(len(order.get(d, [])) > keep[d] for d in keep):
        for d in sorted(keep):
            lst = order.get(d, [])
            if len(lst) <= keep[d]:
                continue
            j = lst[-1]
            t = dst[j]
            e = t.dim if isinstance(t, Shard) else None
            lands = (e is not None and e != d and len(order.get(e, [])) == keep[e]
                     and len(tgt[e]) > keep[e] and tgt[e][keep[e]] == j)
            new = t if lands else Replicate()
            steps.append(Step(j, cur[j], new, tuple(cur), _freeze(order)))
            cur[j] = new
            lst.pop()
            if lands:
                order.setdefault(e, []).append(j)
                keep[e] += 1

    for d in sorted(tgt):
        for j in tgt[d][len(order.get(d, [])):]:
            assert not isinstance(cur[j], Shard), (src, dst, cur)
            steps.append(Step(j, cur[j], Shard(d), tuple(cur), _freeze(order)))
            cur[j] = Shard(d)
            order.setdefault(d, []).append(j)

    for j, (c, t) in enumerate(zip(cur, dst)):
        if isinstance(c, Partial) and c != t:
            if type(t) is Partial and type(c) is Partial and {c.reduce_op, t.reduce_op} == {"sum", "avg"}:
                emit(j, t)
            else:
                emit(j, Replicate())
    for j, (c, t) in enumerate(zip(cur, dst)):
        if c != t:
            assert isinstance(c, Replicate) and isinstance(t, Partial), (src, dst, cur)
            emit(j, t)
    assert tuple(cur) == tuple(dst) and _freeze(order) == tuple(dst_order), (src, src_order, dst, dst_order, cur, order)
    return tuple(steps)
