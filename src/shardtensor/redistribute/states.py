"""The planner search's states: per-mesh tables, a spec encoded as a state int, and a path of
moves read back as ``Step``s.

A state is an int with ``W`` bits per mesh dim: 0 = Replicate, 1 = the source's Partial,
``2 + d*m + p`` = Shard(d) at position ``p`` of ``d``'s shard list (``m`` mesh dims).  A move
is ``(mesh dim, kind, tensor dim)``; kinds: 0 all-gather, 1 all-to-all, 2 all-reduce,
3 reduce-scatter, 4 chunk (kinds 0 and 2 end in Replicate).  docs/redistribution.md describes
the graph.
"""
from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache
from typing import Sequence

from ..placement import Placement, Replicate, Shard, ShardOrder
from .cost import LinkModel
from .steps import Step

__all__ = ["AG", "A2A", "AR", "RS", "CHUNK", "mesh_tables", "encode", "path_moves", "to_steps"]

AG, A2A, AR, RS, CHUNK = 0, 1, 2, 3, 4
_REPLICATE = Replicate()


def _int_weights(values: Sequence[float]) -> tuple[int, ...]:
    """Small integers proportional to ``values`` (all equal -> all 1; zeros stay 0)."""
    pos = [v for v in values if v > 0]
    if not pos:
        return (0,) * len(values)
    lo = min(pos)
    if all(v == lo or v == 0 for v in values):
        return tuple(1 if v else 0 for v in values)
    fr = [Fraction(v / lo).limit_denominator(1000) if v else Fraction(0) for v in values]
    den = 1
    for f in fr:
        den = den * f.denominator // math.gcd(den, f.denominator)
    return tuple(int(f * den) for f in fr)


@lru_cache(maxsize=256)
def mesh_tables(mesh_shape: tuple[int, ...], N: int, links: tuple[LinkModel, ...]):
    """Per (mesh shape, tensor rank, links) constants: the state encoding and the edge weights.

    Costs are exact integers: elements x ``S = K_all * lcm(k)`` (so every all-reduce ``/k`` and
    every term of the bound divides exactly), bandwidth weighted per mesh dim by ``wb`` and
    shifted above the latency (weighted by ``wa``), which has room for 512 collectives."""
    ks = mesh_shape
    K_all = math.prod(ks)
    S = K_all * math.lcm(*ks) if ks else 1
    wb = _int_weights([lk.beta for lk in links])
    wa = _int_weights([lk.alpha for lk in links])
    shift = max(24, (2 * max(ks, default=1) * max(wa + (1,)) * 512).bit_length())
    pos_wb = [w for w, k in zip(wb, ks) if k > 1 and w > 0]
    hmul = (min(pos_wb) if pos_wb else 0) << shift  # the bound is priced on the cheapest link
    m = len(ks)
    W = max(2, (1 + N * m).bit_length())
    SH = tuple(W * j for j in range(m))
    CD = (-1, -1) + tuple(c // m for c in range(N * m))
    CP = (-1, -1) + tuple(c % m for c in range(N * m))
    AG = tuple(((k - 1) * S * wb[j]) << shift for j, k in enumerate(ks))
    AR = tuple(((2 * (k - 1) * (S // k)) * wb[j]) << shift for j, k in enumerate(ks))
    LAT1 = tuple((k - 1) * wa[j] for j, k in enumerate(ks))
    LAT2 = tuple(2 * (k - 1) * wa[j] for j, k in enumerate(ks))
    return ks, K_all, S, hmul, (1 << W) - 1, SH, CD, CP, AG, AR, LAT1, LAT2


def encode(pl: tuple, order: ShardOrder, m: int, N: int, SH: tuple, what: str) -> int:
    """Validate a spec (placements and shard order agree) and encode it as a state int."""
    if len(pl) != m:
        raise ValueError(f"{what} placements {pl} do not match a mesh with {m} dims")
    code = 0
    nshard = 0
    for j, p in enumerate(pl):
        if p.is_shard():
            nshard += 1
        elif p.is_partial():
            code |= 1 << SH[j]
    seen = 0
    dims = 0
    for d, js in order:
        if not js:
            raise ValueError(f"{what} shard order {order}: tensor dim {d} has an empty mesh-dim list")
        if not 0 <= d < N or dims >> d & 1:
            raise ValueError(f"{what} shard order {order}: tensor dim {d} out of range for {N} dims or repeated")
        dims |= 1 << d
        for pos, j in enumerate(js):
            if not 0 <= j < m or seen >> j & 1:
                raise ValueError(f"{what} shard order {order} does not match placements {pl}")
            p = pl[j]
            if not p.is_shard() or p.dim != d:
                raise ValueError(f"{what} shard order {order} does not match placements {pl}")
            seen |= 1 << j
            code |= (2 + d * m + pos) << SH[j]
    if bin(seen).count("1") != nshard:
        raise ValueError(f"{what} shard order {order} does not list every sharding mesh dim of {pl}")
    return code


def path_moves(prev: dict, found: int, start: int, N: int) -> list[tuple[int, int, int]]:
    """The ``(mesh dim, kind, tensor dim)`` moves from ``start`` to ``found``, with the tensor
    dims of relabelled states (``search._Problem._lower``, ``_start_on_d1``) mapped back to the real ones."""
    path = []
    while found != start:
        found, mv, perm = prev[found]
        path.append((mv, perm))
    real = list(range(N))  # real[label]: the tensor dim a label of the current state stands for
    moves = []
    for mv, perm in reversed(path):
        kind, b = mv >> 8 & 0xF, mv >> 12
        moves.append((mv & 0xFF, kind, b if kind in (AG, AR) else real[b]))  # (AG, AR name no dim)
        if perm is not None:
            nxt = real[:]
            for old, new in enumerate(perm):
                nxt[new] = real[old]
            real = nxt
    return moves


def to_steps(moves, src, src_order, dst, dst_order) -> tuple[Step, ...]:
    """Turn ``(mesh dim, kind, tensor dim)`` moves into ``Step``s, then append the free tail:
    ``R -> P`` partitions and ``sum <-> avg`` rescales, which change no size and enable nothing."""
    cur = list(src)
    lists = {d: js for d, js in src_order}
    frozen = src_order
    steps: list[Step] = []
    for j, kind, b in moves:
        p = cur[j]
        to_r = kind in (AG, AR)
        new: Placement = _REPLICATE if to_r else Shard(b)
        steps.append(Step(j, p, new, tuple(cur), frozen))
        if p.is_shard():
            lists[p.dim] = lists[p.dim][:-1]
        if not to_r:
            lists[b] = lists.get(b, ()) + (j,)
        frozen = tuple((d, lists[d]) for d in sorted(lists) if lists[d])
        cur[j] = new
    for j, t in enumerate(dst):
        if t.is_partial() and cur[j] != t:
            steps.append(Step(j, cur[j], t, tuple(cur), frozen))
            cur[j] = t
    assert tuple(cur) == tuple(dst) and frozen == tuple(dst_order), (src, src_order, dst, dst_order, moves)
    return tuple(steps)
