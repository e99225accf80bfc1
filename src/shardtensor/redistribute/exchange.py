"""Direct exchange: a whole shard-to-shard redistribution as one all-to-all over a flattened group.

Every rank knows, from the specs alone, which block of the global tensor it holds and which
block it must end with.  When neither spec has a Partial on the mesh dims that change, the
redistribution can be done in one collective: each rank sends every peer of the flattened
group the intersection of what it holds with what the peer needs, unpadded.  That is never
more than what the peer is missing, so it can beat any sequence of per-mesh-dim steps, which
must pass through intermediate layouts.  ``(S0,S0) -> (R,S0)`` on a (2,2) mesh: the per-dim
optimum is all-to-all, all-gather, all-to-all (2.5/4 of the tensor per rank, three
collectives); the exchange sends at most 2/4 per rank in one.

The group is every mesh dim whose placement or shard-list position changes (a mesh dim that
is replicated, the same partial, or the same shard with the same list prefix in both specs
splits the problem into independent groups).  Replicated data has several holders; the one
whose coordinates on the source's replicated mesh dims equal the receiver's sends it, so
every block is sent once and the load is spread.

Cost (``exchange_comm``): bytes per rank = the most any rank sends or receives, over the
whole mesh, so the choice is rank independent; ``K-1`` latency terms (pairwise exchange) and
one launch.  Priced on meshes of at most ``MAX_RANKS`` ranks (the pricing enumerates rank
pairs); larger meshes keep the per-dim plan.
"""
from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Sequence

from ..placement import Partial, Placement, Replicate, Shard, ShardOrder, local_shape_and_offset

__all__ = ["exchange_dims", "exchange_comm", "exchange_loads", "blocks", "MAX_RANKS"]

MAX_RANKS = 64


def exchange_dims(src: Sequence[Placement], src_order: ShardOrder, dst: Sequence[Placement],
                  dst_order: ShardOrder, mesh_shape: Sequence[int]) -> tuple[int, ...] | None:
    """The mesh dims a direct exchange spans, or ``None`` if it does not apply (partials, size)."""
    if math.prod(mesh_shape) > MAX_RANKS:
        return None
    ls, ld = dict(src_order), dict(dst_order)
    dims = []
    for j, (a, b) in enumerate(zip(src, dst)):
        if mesh_shape[j] == 1:
            continue
        if a == b:
            if not isinstance(a, Shard):
                continue
            la, lb = ls[a.dim], ld[a.dim]
            p = la.index(j)
            if la[:p + 1] == lb[:p + 1]:
                continue
        if isinstance(a, Partial) or isinstance(b, Partial):
            return None
        dims.append(j)
    return tuple(dims) if len(dims) > 1 else None


def _box(shape, mesh_shape, coord, pl, order):
    size, off = local_shape_and_offset(shape, mesh_shape, coord, pl, order)
    return tuple(off), tuple(size)


def _overlap(a, b) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Intersection of two ``(offset, size)`` boxes, or None when empty."""
    (oa, sa), (ob, sb) = a, b
    off, size = [], []
    for x, n, y, m in zip(oa, sa, ob, sb):
        lo, hi = max(x, y), min(x + n, y + m)
        if hi <= lo:
            return None
        off.append(lo)
        size.append(hi - lo)
    return tuple(off), tuple(size)


def blocks(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], dims: Sequence[int],
           src: Sequence[Placement], src_order: ShardOrder, dst: Sequence[Placement], dst_order: ShardOrder):
    """For the rank at ``coord``: its group's coordinates (row-major over ``dims``), and per peer
    the global box it sends there and the box it receives from there (``None``: nothing)."""
    rdims = [j for j in dims if isinstance(src[j], Replicate)]
    me_held = _box(shape, mesh_shape, coord, src, src_order)
    me_need = _box(shape, mesh_shape, coord, dst, dst_order)
    peers, send, recv = [], [], []
    for sub in itertools.product(*(range(mesh_shape[j]) for j in dims)):
        c = list(coord)
        for j, v in zip(dims, sub):
            c[j] = v
        peers.append(tuple(c))
        same_r = all(c[j] == coord[j] for j in rdims)
        if same_r:  # this rank serves the peer, and the peer serves this rank
            send.append(_overlap(me_held, _box(shape, mesh_shape, c, dst, dst_order)))
            recv.append(_overlap(_box(shape, mesh_shape, c, src, src_order), me_need))
        else:
            send.append(None)
            recv.append(None)
    return peers, send, recv


def exchange_comm(shape: tuple[int, ...], mesh_shape: tuple[int, ...], dims: tuple[int, ...],
                  src: tuple, src_order: ShardOrder, dst: tuple, dst_order: ShardOrder) -> tuple[int, int]:
    """``(elements, latency terms)``: the most elements any rank sends or receives to or from
    its peers, and the pairwise-exchange latency."""
    send, recv = exchange_loads(shape, mesh_shape, dims, src, src_order, dst, dst_order)
    return max(send, recv), math.prod(mesh_shape[j] for j in dims) - 1


@lru_cache(maxsize=4096)
def exchange_loads(shape: tuple[int, ...], mesh_shape: tuple[int, ...], dims: tuple[int, ...],
                   src: tuple, src_order: ShardOrder, dst: tuple, dst_order: ShardOrder) -> tuple[int, int]:
    """``(most elements a rank sends, most elements a rank receives)``.  What a rank receives is
    exactly the part of its target block it does not hold: no plan can deliver less."""
    most_s = most_r = 0
    for coord in itertools.product(*(range(k) for k in mesh_shape)):
        _, send, recv = blocks(shape, mesh_shape, coord, dims, src, src_order, dst, dst_order)
        me = 0
        for j in dims:
            me = me * mesh_shape[j] + coord[j]
        most_s = max(most_s, sum(math.prod(b[1]) for i, b in enumerate(send) if b is not None and i != me))
        most_r = max(most_r, sum(math.prod(b[1]) for i, b in enumerate(recv) if b is not None and i != me))
    return most_s, most_r
