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
splits the problem into independent groups).  Replicated data has several holders, told apart
by their coordinates on the source's replicated mesh dims (``_serving``): a receiver that holds
part of what it needs is served by the holders with its own coordinates there (so it is never
sent what it has); one that holds none of it by the holders shifted by its coordinates on the
target's replicated mesh dims, so that the ranks needing the same block are served by different
holders.  Either way the serving holders hold the whole tensor once, so every block is sent once.

Cost (``exchange_comm``): bytes per rank = the most any rank sends or receives, over the
whole mesh, so the choice is rank independent; ``K-1`` latency terms (pairwise exchange) and
one launch.  A rank receives exactly the part of its target block it does not hold, so the
busiest receiver is one pass over the ranks (``exchange_floor``); the busiest sender pairs each
receiver with the holders of its serving class (``exchange_loads``).  Priced on meshes of at
most ``MAX_RANKS`` ranks (vectorised); larger meshes keep the per-dim plan.
"""
from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Sequence

import numpy as np

from ..placement import Placement, ShardOrder, execution_order, local_shape_and_offset, shard_dim

__all__ = ["overlap", "exchange_dims", "exchange_bound", "exchange_lack", "exchange_floor", "exchange_comm", "exchange_loads",
           "blocks", "clear_caches", "MAX_RANKS"]

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
            d = shard_dim(a)
            if d is None:
                continue
            la, lb = ls[d], ld[d]
            p = la.index(j)
            if la[:p + 1] == lb[:p + 1]:
                continue
        if a.is_partial() or b.is_partial():
            return None
        dims.append(j)
    return tuple(dims) if len(dims) > 1 else None


def _box(shape, mesh_shape, coord, pl, order):
    size, off = local_shape_and_offset(shape, mesh_shape, coord, pl, order)
    return tuple(off), tuple(size)


def overlap(a, b) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
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


@lru_cache(maxsize=4096)
def blocks(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...], dims: tuple[int, ...],
           src: tuple, src_order: ShardOrder, dst: tuple, dst_order: ShardOrder):
    """For the rank at ``coord``, per peer of its group (row-major over ``dims``): the global box
    it sends there and the box it receives from there (``None``: nothing).
    Cached: the executor asks once per (rank, redistribution)."""
    rdims = [j for j in dims if src[j].is_replicate()]
    me_held = _box(shape, mesh_shape, coord, src, src_order)
    me_need = _box(shape, mesh_shape, coord, dst, dst_order)
    my_server = _serving(shape, mesh_shape, coord, dims, src, src_order, dst, dst_order)
    send, recv = [], []
    for sub in itertools.product(*(range(mesh_shape[j]) for j in dims)):
        c = list(coord)
        for j, v in zip(dims, sub):
            c[j] = v
        peer = tuple(c)
        serves_peer = _serving(shape, mesh_shape, peer, dims, src, src_order, dst, dst_order) == \
            tuple(coord[j] for j in rdims)
        send.append(overlap(me_held, _box(shape, mesh_shape, peer, dst, dst_order)) if serves_peer else None)
        served = my_server == tuple(peer[j] for j in rdims)
        recv.append(overlap(_box(shape, mesh_shape, peer, src, src_order), me_need) if served else None)
    return tuple(send), tuple(recv)


def _serving(shape, mesh_shape, coord, dims, src, src_order, dst, dst_order) -> tuple[int, ...]:
    """The coordinates, on the group's mesh dims that replicate the source, of the holders that
    send the rank at ``coord`` what it needs (see the module docstring)."""
    rdims = [j for j in dims if src[j].is_replicate()]
    own = tuple(coord[j] for j in rdims)
    if not rdims or overlap(_box(shape, mesh_shape, coord, src, src_order),
                             _box(shape, mesh_shape, coord, dst, dst_order)) is not None:
        return own
    tdims = [j for j in dims if dst[j].is_replicate()]
    shift = 0
    for j in tdims:
        shift = shift * mesh_shape[j] + coord[j]
    return _add_digits(own, shift, [mesh_shape[j] for j in rdims])


def _add_digits(digits: tuple[int, ...], n: int, radix: list[int]) -> tuple[int, ...]:
    """``digits`` (row-major, mixed radix) plus ``n``, modulo the radix product."""
    value = 0
    for d, r in zip(digits, radix):
        value = value * r + d
    value = (value + n) % math.prod(radix)
    out = []
    for r in reversed(radix):
        value, d = divmod(value, r)
        out.append(d)
    return tuple(reversed(out))


def exchange_bound(shape: tuple[int, ...], mesh_shape: tuple[int, ...], dims: tuple[int, ...],
                   src: tuple, src_order: ShardOrder, dst: tuple, dst_order: ShardOrder) -> int:
    """A cheap upper bound of ``exchange_comm``'s elements: a rank receives at most its target
    block, and sends each element it holds to at most the ranks of the group that replicate it
    in the target (blocks at coordinate 0 are the largest)."""
    zero = (0,) * len(mesh_shape)
    held = math.prod(local_shape_and_offset(shape, mesh_shape, zero, src, src_order)[0])
    need = math.prod(local_shape_and_offset(shape, mesh_shape, zero, dst, dst_order)[0])
    copies = math.prod(mesh_shape[j] for j in dims if dst[j].is_replicate())
    return max(need, held * copies)


def exchange_lack(shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple, src_order: ShardOrder,
                  dst: tuple, dst_order: ShardOrder, coord: tuple[int, ...] | None = None) -> int:
    """What the rank at ``coord`` (default: coordinate 0) receives in the exchange: the part of its
    target block it does not hold.  A lower bound of ``exchange_floor`` that costs two box
    computations, not a pass over the ranks."""
    coord = coord if coord is not None else (0,) * len(mesh_shape)
    held = _box(shape, mesh_shape, coord, src, src_order)
    need = _box(shape, mesh_shape, coord, dst, dst_order)
    both = overlap(held, need)
    return math.prod(need[1]) - (math.prod(both[1]) if both is not None else 0)


def exchange_floor(shape: tuple[int, ...], mesh_shape: tuple[int, ...], dims: tuple[int, ...],
                   src: tuple, src_order: ShardOrder, dst: tuple, dst_order: ShardOrder) -> int:
    """A lower bound of ``exchange_comm``'s elements, cheaper than it (one pass over the ranks,
    not over the pairs that may exchange): the most any rank receives, the part of its target
    block it does not hold."""
    return _rank_blocks(shape, mesh_shape, dims, src, src_order, dst, dst_order)[-1]


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
    exactly the part of its target block it does not hold: no plan can deliver less.

    Vectorised (numpy) over each receiver and the holders that may serve it: ranks of its group
    (the same coordinates off ``dims``) whose coordinates on the group's mesh dims that
    replicate the source are the ones ``_serving`` names.  A pair's overlap is a product over
    tensor dims, taken one tensor dim at a time (a dim no rank splits is one number).
    """
    coords, ho, he, no, ne, both, recv = _rank_blocks(shape, mesh_shape, dims, src, src_order, dst, dst_order)
    ranks = coords.shape[1]
    G = math.prod(mesh_shape[j] for j in dims)
    O = ranks // G
    # a rank's index in its group is row-major over ``dims``; holders of one serving class
    # differ only on the group's other mesh dims
    stride, step = {}, 1
    for j in reversed(dims):
        stride[j] = step
        step *= mesh_shape[j]
    rdims = [j for j in dims if src[j].is_replicate()]
    base = np.zeros(ranks, np.int64)
    if rdims:  # _serving, for every rank at once
        radix = [mesh_shape[j] for j in rdims]
        shift = np.zeros(ranks, np.int64)
        for j in dims:
            if dst[j].is_replicate():
                shift = shift * mesh_shape[j] + coords[j]
        value = np.zeros(ranks, np.int64)
        for j in rdims:
            value = value * mesh_shape[j] + coords[j]
        value = np.where(both > 0, value, (value + shift) % math.prod(radix))
        for j in reversed(rdims):
            value, digit = np.divmod(value, mesh_shape[j])
            base += digit * stride[j]
    offsets = np.zeros(1, np.int64)
    for j in dims:
        if j not in rdims:
            offsets = (offsets[:, None] + np.arange(mesh_shape[j]) * stride[j]).reshape(-1)
    # holder of pair (receiver s, i): global row; its box against s's target box
    first = np.repeat(np.arange(O) * G, G)
    holder = first[:, None] + base[:, None] + offsets[None, :]
    inter = np.ones(holder.shape, np.int64)
    for d in range(len(shape)):
        ov = np.minimum(_per_pair(he[d], holder), _per_receiver(ne[d])) - \
            np.maximum(_per_pair(ho[d], holder), _per_receiver(no[d]))
        inter *= np.maximum(ov, 0)
    inter[holder == np.arange(ranks)[:, None]] = 0  # a rank keeps what it holds
    send = np.bincount(holder.reshape(-1), inter.reshape(-1), minlength=ranks)
    return int(round(send.max(initial=0))), recv


def _per_pair(x, holder: np.ndarray):
    """A per-rank value (array, or one int for all ranks) at each pair's holder."""
    return x.take(holder) if isinstance(x, np.ndarray) else x


def _per_receiver(x):
    """A per-rank value (array, or one int for all ranks) broadcast over each receiver's row."""
    return x[:, None] if isinstance(x, np.ndarray) else x


@lru_cache(maxsize=64)
def _rank_blocks(shape: tuple[int, ...], mesh_shape: tuple[int, ...], dims: tuple[int, ...],
                 src: tuple, src_order: ShardOrder, dst: tuple, dst_order: ShardOrder) -> tuple:
    """Every rank's coordinates (``_group_coords``), held and needed boxes per tensor dim (starts
    and ends, ``_boxes``), how much of its need it holds, and the most any rank must receive
    (what it needs and lacks)."""
    coords = _group_coords(mesh_shape, dims)
    ho, hs = _boxes(shape, mesh_shape, coords, src, src_order)
    no, ns = _boxes(shape, mesh_shape, coords, dst, dst_order)
    he = [o + n for o, n in zip(ho, hs)]
    ne = [o + n for o, n in zip(no, ns)]
    both = need = np.ones(coords.shape[1], np.int64)
    for d in range(len(shape)):
        both = both * np.maximum(np.minimum(he[d], ne[d]) - np.maximum(ho[d], no[d]), 0)
        need = need * ns[d]
    return coords, ho, he, no, ne, both, int((need - both).max(initial=0))


def clear_caches() -> None:
    """Forget every priced exchange (benchmarks time cold plans)."""
    exchange_loads.cache_clear()
    _rank_blocks.cache_clear()


@lru_cache(maxsize=256)
def _group_coords(mesh_shape: tuple[int, ...], dims: tuple[int, ...]) -> np.ndarray:
    """Every rank's coordinates ``(mesh ndim, ranks)`` (row ``j``: the coordinate on mesh dim
    ``j``), ranks ordered so that each run of ``prod(mesh_shape[dims])`` shares its coordinates
    off ``dims``."""
    perm = [j for j in range(len(mesh_shape)) if j not in dims] + list(dims)
    idx = np.indices([mesh_shape[j] for j in perm]).reshape(len(perm), -1)
    coords = np.empty_like(idx)
    coords[perm] = idx
    return coords


def _boxes(shape, mesh_shape, coords: np.ndarray, pl, order) -> tuple[list, list]:
    """Per tensor dim, every rank's block start and length (``local_shape_and_offset``,
    vectorised): an array over the ranks, or one int where no mesh dim splits the dim."""
    off: list = [0] * len(shape)
    size: list = list(shape)
    for j in execution_order(pl, order):
        d = pl[j].dim
        length = size[d]
        c = -(-length // mesh_shape[j])
        o = np.minimum(c * coords[j], length)
        size[d] = np.minimum(c, length - o)
        off[d] = off[d] + o
    return off, size
