"""The cheapest per-mesh-dim plan between two specs: an A* search over (placements, shard order).

The graph, its costs and the bound are described in docs/redistribution.md ("How the planner
searches"); states and moves are encoded as ``states.py`` describes.  Read top-down: ``search``
sets up a ``_Problem`` (tables of the mesh, facts of the target), then pops states in order of a
lower bound of their total cost; ``_Problem.decode`` reads a state, ``_Problem.expand`` queues
its successors priced with the bound, and ``states.to_steps`` turns the moves of the cheapest
path into ``Step``s (``states.path_moves`` maps the tensor dims of states whose two
interchangeable scratch dims were swapped, ``_Problem._lower``, ``_start_on_d1``, back to the real ones).

The bound of a state is a function of six numbers (``_Problem.expand`` spells it out):
products of the mesh sizes per category (sharding, replicated but headed for a shard, partial
still to reduce, free) and the weights of the moves still needed.  A move changes one mesh
dim's category, so a successor's numbers are its parent's with one mesh dim's share swapped:
pricing a successor costs a dozen integer operations, not a decode.
"""
from __future__ import annotations

import heapq
import math
from typing import Callable

from ..placement import Replicate, ShardOrder
from .baseline import baseline_plan
from .cycles import clear_caches as clear_cycle_caches
from .cycles import cycle_extra
from .cost import LinkModel
from .states import A2A as _A2A, AG as _AG, AR as _AR, CHUNK as _CHUNK, RS as _RS
from .states import encode, mesh_tables, path_moves, to_steps
from .steps import Step

__all__ = ["search", "clear_caches", "MAX_EXPANSIONS", "CEILING_AFTER", "LOWER"]

MAX_EXPANSIONS = 1024
"""Expanded states before the search gives up and returns the baseline plan (correct, never
more bytes than itself; not reached on the planner benchmark's pairs)."""

CEILING_AFTER = (2, 4)
"""Expanded states before the search asks for cheap bounds of its ``ceiling``: an upper bound,
then the cheapest lower one (easy plans never pay for either).  Each dearer value (``LOWER``,
then the exact one) is asked only once the queue's smallest bound passes the last lower one."""

LOWER = ("first", "lower", "exact")
"""The ``ceiling`` kinds a search asks for in turn, cheapest first: lower bounds, then the value."""

_REPLICATE = Replicate()
_INF = 1 << 4000
# a move, packed: mesh dim | kind << 8 | tensor dim << 12 (kinds: ``states.py``)


def search(mesh_shape: tuple[int, ...], links: tuple[LinkModel, ...], src: tuple, src_order: ShardOrder,
           dst: tuple, dst_order: ShardOrder, shape: tuple[int, ...],
           ceiling: Callable[[str], int] | None = None) -> tuple[tuple[Step, ...] | None, dict]:
    """``(steps, info)``: the cheapest per-mesh-dim plan and the search's counters
    (``expanded``, ``generated``, ``capped``, ``cut``, and ``other_loses``: the plan moves less
    than a lower bound of the ``ceiling`` asked for).  Arguments are normalised (``planner.py``).

    ``ceiling(kind)``, if given, gives the elements per rank that another plan moves (the
    direct plan): ``"exact"``, or an ``"upper"`` bound of them, or a ``"first"`` or ``"lower"``
    one (the second tighter and dearer).  Once every per-dim plan is known to move more, the
    search stops and returns ``None`` (``info["cut"]``): the caller takes the other plan.  The
    upper and the first lower bound are asked after ``CEILING_AFTER`` expanded states; each next
    kind of ``LOWER`` only when the queue's smallest bound passes the last lower one, so a search
    that ends below a bound never pays for the next.  Only for links of one bandwidth (the units
    are plain elements)."""
    info = {"expanded": 0, "generated": 0, "capped": False, "cut": False}
    pb = _Problem(mesh_shape, links, src, src_order, dst, dst_order, shape)
    if pb.done(pb.start):
        return to_steps((), src, src_order, dst, dst_order), info
    free = _free_plan(src, src_order, dst_order, pb.compat)
    if free is not None:
        return to_steps(free, src, src_order, dst, dst_order), info
    best = {pb.start: 0}
    prev: dict[int, tuple[int, int, tuple | None]] = {}
    cycles_priced: set[int] = set()
    requeued: dict[int, tuple] = {}  # decoded states queued again with their cycle price
    # queue items (f, -g, state): ties go to the deeper state, then to the smaller state code
    # (a total order: nothing depends on hashing, so every rank finds the same plan)
    pq = [(0, 0, pb.start)]
    found = None
    # f at or above ``low`` may pass the ceiling, at or above ``above`` it does; ``asked``: how
    # many kinds of ``LOWER`` were asked (all of them: ``above`` is exact)
    low = above = _INF
    asked = floor = 0  # floor: the last lower bound (or exact value) asked, in elements
    expanded = 0
    pop, push, decode, expand = heapq.heappop, heapq.heappush, pb.decode, pb.expand
    GM, goal = pb.GM, pb.goal
    while pq:
        f, ng, st = pop(pq)
        g = -ng
        if g != best[st]:
            continue  # reached more cheaply since this entry was queued
        while f >= low and asked < len(LOWER):
            assert ceiling is not None
            low, above, asked, floor = _next_bound(pb, ceiling, asked, above)
        if f >= above:
            info["cut"], info["expanded"] = True, expanded
            return None, info
        if st & GM == goal:  # pb.done
            found = st
            break
        dec = requeued.pop(st, None) or decode(st)
        if len(dec[-1]) > 1 and st not in cycles_priced:
            # shards waiting for each other's places: priced once per state, when first popped
            cycles_priced.add(st)
            extra = cycle_extra(dec[-1])
            if extra:
                requeued[st] = dec
                push(pq, (f + extra, ng, st))
                continue
        expanded += 1
        if ceiling is not None and expanded in CEILING_AFTER:
            if expanded == CEILING_AFTER[0]:
                above = pb.above(ceiling("upper"))
            else:
                low, above, asked, floor = _next_bound(pb, ceiling, 0, above)
        if expanded > MAX_EXPANSIONS:
            info["capped"] = True
            break
        expand(st, g, dec, best, prev, pq)
    info["generated"], info["expanded"] = len(best), expanded
    if found is None:
        return baseline_plan(src, src_order, dst, dst_order), info
    # the other plan moves at least ``floor`` elements: strictly more bandwidth loses outright
    info["other_loses"] = asked > 0 and pb.hmul > 0 and best[found] // pb.hmul < floor * pb.S
    return to_steps(path_moves(prev, found, pb.start, pb.N), src, src_order, dst, dst_order), info


def _next_bound(pb: "_Problem", ceiling: Callable[[str], int], asked: int, above: int) -> tuple[int, int, int, int]:
    """Asks ``ceiling`` for the next kind of ``LOWER``: ``(low, above, asked, elements)``, the
    cost at which the search asks again (none after the exact value) and the one at which it
    stops."""
    kind = LOWER[asked]
    elements = ceiling(kind)
    if kind == "exact":
        return _INF, pb.above(elements), asked + 1, elements
    return pb.above(elements), above, asked + 1, elements


def _free_plan(src, src_order: ShardOrder, dst_order: ShardOrder, compat: list[bool]) -> list | None:
    """The moves of a plan that costs nothing, if there is one: every source shard list is a
    prefix of its target list, every other target shard is replicated now, and every source
    partial may stay.  Then the target shards are chunks, in target order."""
    lists = dict(src_order)
    chunks = []
    for d, js in dst_order:
        have = lists.pop(d, ())
        if js[:len(have)] != have:
            return None
        for j in js[len(have):]:
            if not src[j].is_replicate():
                return None
            chunks.append((j, _CHUNK, d))
    if lists or not all(compat[j] for j, p in enumerate(src) if p.is_partial()):
        return None
    return chunks


class _Problem:
    """One search: the mesh's tables, the target's facts, and the three operations on a state.

    A state is an int with ``W`` bits per mesh dim: 0 = Replicate, 1 = the source's Partial,
    ``2 + d*m + p`` = Shard(d) at position ``p`` of ``d``'s shard list.  Costs are exact integers
    ``bandwidth << shift | latency`` (bandwidth first, then latency, in one comparison).
    """

    def __init__(self, mesh_shape, links, src, src_order, dst, dst_order, shape) -> None:
        m, N = len(mesh_shape), len(shape)
        self.m, self.N, self.shape = m, N, shape
        t = mesh_tables(mesh_shape, N, links)
        (self.ks, self.K_all, S, self.hmul, self.MASK, self.SH, self.CD, self.CP, self.AG, self.AR,
         self.LAT1, self.LAT2) = t
        self.start = encode(src, src_order, m, N, self.SH, "source")
        self.goal = encode(tuple(p if p.is_shard() else _REPLICATE for p in dst), dst_order, m, N,
                            self.SH, "target")
        # target facts per mesh dim; a compatible source partial may stay (goal mask GM)
        self.tS = [b.is_shard() for b in dst]
        self.TD = [b.dim if b.is_shard() else -1 for b in dst]
        self.compat = [b.is_partial() and (a == b or a.rescales_to(b)) for a, b in zip(src, dst)]
        self.GM = -1
        for j in range(m):
            if self.compat[j]:
                self.GM &= ~(1 << self.SH[j])
        T: list[tuple] = [()] * N
        for d, js in dst_order:
            T[d] = js
        self.T = T
        self.TL = [len(x) for x in T]
        self.TDIMS = [d for d in range(N) if T[d]]
        self.S = S
        self._bound_tables(S)
        self.volumes: dict[tuple[int, ...], tuple] = {}  # _volume's facts per split
        self._interchangeable(src_order)
        # per mesh dim, what ``expand`` reads of it: shift, size, target dim, whether the target
        # shards, move weights (all-gather, latency, all-to-all, twice that, all-reduce, its
        # latency), whether a source partial may stay, and the mask that clears its code
        self.rows = [(self.SH[j], self.ks[j], self.TD[j], self.tS[j], self.AG[j], self.LAT1[j], self.AU[j],
                      self.AU2[j], self.AR[j], self.LAT2[j], self.compat[j], ~(self.MASK << self.SH[j]))
                     for j in range(m)]

    def _bound_tables(self, S: int) -> None:
        """Constants of the bound (docs/redistribution.md): the volume at the goal, the weight of
        an all-to-all per mesh dim, and which later entries a shard left above would make dearer."""
        ks, m, T = self.ks, self.m, self.T
        XS = math.prod(self.shape) * S
        self.XS = XS
        self.PHIEND = XS // math.prod(ks[j] for j in range(m) if self.tS[j])
        AU = [(k - 1) * (XS // (k * self.K_all)) for k in ks]
        self.AU, self.AU2 = AU, [2 * a for a in AU]
        self.CYW = [a * self.hmul for a in AU]
        self.PK = []
        for t in T:
            row, later = [0] * len(t), 0
            for p in range(len(t) - 1, -1, -1):
                later |= ks[t[p]] > 1
                row[p] = later
            self.PK.append(row)

    def _interchangeable(self, src_order: ShardOrder) -> None:
        """Sets of interchangeable tensor dims: no target entries and one size class (the same
        length, or lengths that every mesh size divides), so states that differ by swapping their
        stacks cost the same to finish.  An empty one whose set's first dim is empty too is never
        pushed onto (``twins``: its plans mirror the first one's).  When a set is exactly two dims
        that both start empty, they are scratch space that chunks and reductions fill in either
        order; the search keeps such states in one order (``pair``: ``d0`` before ``d1``, a lone
        stack on ``d0``, two stacks by the mesh dims at their bottoms) and relabels a successor
        that breaks it (``_lower``, ``_start_on_d1``).  ``pair`` is ``(-1, -1)`` when none."""
        groups: dict[object, list[int]] = {}
        for d in range(self.N):
            if not self.T[d]:
                groups.setdefault("even" if self.shape[d] % self.K_all == 0 else self.shape[d], []).append(d)
        self.twins = [(d, g[0]) for g in groups.values() for d in g[1:]]
        self.pair: tuple[int, int] = (-1, -1)
        self.swap_perm: tuple[int, ...] = ()
        used = {d for d, _ in src_order}
        for g in groups.values():
            if len(g) == 2 and not used & set(g):
                d0, d1 = g
                perm = list(range(self.N))
                perm[d0], perm[d1] = d1, d0
                self.pair, self.swap_perm = (d0, d1), tuple(perm)
                return

    def _lower(self, cleared: int, at: list, H: list) -> int:
        """``cleared`` (the parent state without the mesh dim that was alone on the pair's ``d0``)
        with ``d1``'s stack moved down to ``d0``: the pair's order after ``d0`` empties."""
        (d0, d1), m, SH = self.pair, self.m, self.SH
        for q in range(H[d1]):
            cleared -= ((d1 - d0) * m) << SH[at[d1 * m + q]]
        return cleared

    def _start_on_d1(self, cleared: int, j: int, at: list, H: list) -> tuple[int, tuple | None]:
        """The successor in which mesh dim ``j`` (off ``cleared``, the parent state) starts a stack
        on the pair's empty ``d1``, kept in the pair's order: on ``d0`` instead, with ``d0``'s
        stack moved up, when ``j`` sorts before ``d0``'s bottom mesh dim; and the relabelling."""
        (d0, d1), m, SH = self.pair, self.m, self.SH
        if j > at[d0 * m]:
            return cleared | ((2 + d1 * m) << SH[j]), None
        for q in range(H[d0]):
            if at[d0 * m + q] != j:
                cleared += ((d1 - d0) * m) << SH[at[d0 * m + q]]
        return cleared | ((2 + d0 * m) << SH[j]), self.swap_perm

    def above(self, elements: int) -> int:
        """The least cost whose bandwidth exceeds ``elements`` per rank (equal-weight links)."""
        return (elements * self.S + 1) * self.hmul if self.hmul else _INF

    def done(self, st: int) -> bool:
        return st & self.GM == self.goal

    def decode(self, st: int) -> tuple:
        """Per-state facts: codes per mesh dim, list heights, padded sizes, the local volume and
        that over one piece of each dim (``_volume``'s, kept per split), per tensor dim the mesh
        dim that would land in its final place, whether an entry is still pending; the bound's
        six numbers and each mesh dim's share of them; which pushes are pruned and the open
        tensor dims; the misplaced shards headed for another tensor dim as ``(from, to,
        weight)`` edges (waiting-cycle candidates).  One pass per loop, inline: it runs once per
        expansion (benchmarks/README.md, "The search's inner loop")."""
        m, N, ks, CD, CP = self.m, self.N, self.ks, self.CD, self.CP
        codes = [(st >> s) & self.MASK for s in self.SH]
        Kd, H, at = [1] * N, [0] * N, [-1] * (N * m)
        # the bound's numbers: products of sizes of sharding (Kf), replicated-to-shard (KC),
        # partial-to-reduce (KP) and free (KO) mesh dims; move weights A2 and latency LT
        tS, TD, LU, AU, AU2, CYW, compat = self.tS, self.TD, self.LAT1, self.AU, self.AU2, self.CYW, self.compat
        Kf = KC = KP = KO = 1
        A2 = LT = 0
        own, ownl, shards = [0] * m, [0] * m, []
        for j in range(m):
            c, k = codes[j], ks[j]
            if c >= 2:
                d, p = CD[c], CP[c]
                Kd[d] *= k
                Kf *= k
                at[d * m + p] = j
                if p >= H[d]:
                    H[d] = p + 1
                shards.append(j)
            elif c == 1:
                if compat[j]:
                    KO *= k
                else:
                    KP *= k
                    LT += LU[j]
                    ownl[j] = LU[j]
            elif tS[j]:
                KC *= k
            else:
                KO *= k
        split = tuple(Kd)
        vol = self.volumes.get(split)
        if vol is None:
            vol = self.volumes[split] = self._volume(split)
        n, phi, pn, skip, open_dims = vol
        FL, TN, PD = self._final_prefixes(H, at)
        cyc = []
        for j in shards:
            c = codes[j]
            d = CD[c]
            if CP[c] >= FL[d]:  # misplaced: it must leave its place
                if tS[j]:
                    if TD[j] == d:
                        w = AU2[j]
                    else:
                        w = AU[j]
                        cyc.append((d, TD[j], CYW[j]))
                else:
                    w = AU[j] if PD[d] else 0  # it blocks a pending target entry below it
                A2 += w
                own[j] = w
                LT += LU[j]
                ownl[j] = LU[j]
        for d, e in self.twins:  # no push onto the second of two interchangeable empty dims
            if H[d] == 0 and H[e] == 0 and not skip[d]:
                skip = skip[:]
                skip[d] = True
                open_dims = [b for b in open_dims if b != d]
        return codes, H, n, phi, pn, FL, TN, PD, (Kf, KC, KP, KO, A2, LT), own, ownl, at, skip, open_dims, cyc

    def _final_prefixes(self, H: list[int], at: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Per tensor dim: the length of its list's prefix already in its final place (FL), the
        mesh dim whose push would land in its final place (TN, -1: none) and whether a target
        entry still waits above the prefix (PD, its weight)."""
        m, N, T, TL = self.m, self.N, self.T, self.TL
        TN, FL, PD = [-1] * N, [0] * N, [0] * N
        for d in self.TDIMS:  # a dim with no target entries has FL 0, PD 0, TN -1
            t, h, base, tl = T[d], H[d], d * m, TL[d]
            p = 0
            while p < h and p < tl and at[base + p] == t[p]:
                p += 1
            FL[d] = p
            if p < tl:
                PD[d] = self.PK[d][p]
                if p == h:
                    TN[d] = t[h]
        return FL, TN, PD

    def _volume(self, split: tuple[int, ...]) -> tuple:
        """Facts of the local volume when tensor dim ``d`` is split ``split[d]`` ways: padded
        sizes, the volume, the volume over one piece of each dim, the dims a push cannot help (a
        padded piece of at most one element), and the others."""
        n = [-(-x // k) for x, k in zip(self.shape, split)]
        phi = math.prod(n)
        pieces = [phi // x if x else 0 for x in n]
        return n, phi, pieces, [x <= 1 for x in n], [b for b, x in enumerate(n) if x > 1]

    def expand(self, st: int, g: int, dec: tuple, best: dict, prev: dict, pq: list) -> None:
        """Queue every successor of ``st`` reached more cheaply than before, priced ``g + cost + bound``.

        Pushes ``decode`` prunes (``skip``) cannot lead to a cheaper plan (except onto the mover's target).
        A successor's bound numbers are ``st``'s with the moved mesh dim's share swapped, so the
        bound costs a dozen integer operations, not a decode, and only for queued successors.

        The bound (docs/redistribution.md), written out in place (this is the search's inner
        loop): with ``A = XS / Kf``, the volume terms ``x1 = PHIEND + A/KC - 2 A/(KC KP)`` (free
        mesh dims sharded meanwhile) and ``x2``, the same with ``KC KO`` for ``KC`` (not); the
        bound is ``min(x1 + KO A2, x2 + A2)`` in bandwidth units, plus the latency ``LT``.

        Its ~80 lines stay one function on purpose: with the bound's size products and volume
        terms as helper functions the planner's cold p99 rose about 8%, past its 1 ms target
        (benchmarks/README.md, "The search's inner loop")."""
        codes, H, n, phi, pn, FL, TN, PD, (Kf, KC, KP, KO, A2, LT), own, ownl, at, skip, open_dims, _ = dec
        m, N, CD, CP, rows = self.m, self.N, self.CD, self.CP, self.rows
        push, get = heapq.heappush, best.get
        hmul, XS, PE = self.hmul, self.XS, self.PHIEND
        d0, d1 = self.pair
        h1 = H[d1] if d1 >= 0 else 0
        for j in range(m):
            c = codes[j]
            if c >= 2:
                a = CD[c]
                if CP[c] != H[a] - 1:
                    continue  # only the mesh dim last in its list may leave it
            sj, k, tdj, ts, agj, luj, auj, au2j, arj, lu2j, keep, off = rows[j]
            cleared = st & off
            # the bound's numbers without mesh dim j
            a2, lt = A2 - own[j], LT - ownl[j]
            if c >= 2:
                kf, kc, kp, ko = Kf // k, KC, KP, KO
            elif c == 1:
                kf, kc, kp, ko = (Kf, KC, KP, KO // k) if keep else (Kf, KC, KP // k, KO)
            else:
                kf, kc, kp, ko = Kf, (KC // k if ts else KC), KP, (KO if ts else KO // k)
            # to Replicate: all-gather a shard on top of its list, all-reduce a partial
            if c >= 2:
                g2, kind = g + agj * phi + luj, j | _A2A << 8
            elif c == 1:
                a, g2, kind = -1, g + arj * phi + lu2j, j | _RS << 8
            else:
                a, g2, kind = -1, _INF, j | _CHUNK << 8
            # j alone on d0 with a stack on d1: its leaving moves that stack down to d0
            lone = a == d0 and c >= 2 and H[a] == 1
            key, kperm = (self._lower(cleared, at, H), self.swap_perm) if lone and h1 else (cleared, None)
            if c and g2 < get(key, _INF):
                best[key] = g2
                prev[key] = (st, j | (_AG if c >= 2 else _AR) << 8, kperm)
                # the bound with j replicated (it is headed for a shard, or free)
                A = XS // kf
                kc1, ko1 = (kc * k, ko) if ts else (kc, ko * k)
                C2 = kc1 * ko1
                v = PE + A // kc1 - 2 * (A // (kc1 * kp)) + ko1 * a2
                v2 = PE + A // C2 - 2 * (A // (C2 * kp)) + a2
                if v2 < v:
                    v = v2
                push(pq, (g2 + (v * hmul if v > 0 else 0) + lt, -g2, key))
            # to Shard(b), appended last: all-to-all, reduce-scatter or chunk.  Every such
            # successor has the same volume terms of the bound (computed at the first push)
            x1 = x2 = 0
            volume_terms = False
            for b in (open_dims if tdj < 0 or not skip[tdj] else open_dims + [tdj]):
                if b == a:
                    continue
                if b == d1 and not h1:
                    if lone:
                        continue  # a lone shard to the empty twin: the same state relabelled, dearer
                    s2, perm = self._start_on_d1(cleared, j, at, H)
                elif kperm is None:
                    s2, perm = cleared | ((2 + b * m + H[b]) << sj), None  # the code of a push onto b
                elif b == d1:  # j onto d1's stack, which moved down to d0
                    s2, perm = key | ((2 + d0 * m + h1) << sj), kperm
                else:
                    s2, perm = key | ((2 + b * m + H[b]) << sj), kperm
                g2 = g + agj * pn[b] * -(-n[b] // k) + luj if c else g
                if g2 < get(s2, _INF):
                    best[s2] = g2
                    prev[s2] = (st, kind | b << 12, perm)
                    if TN[b] == j:  # lands in its final place
                        aa, ll = a2, lt
                    else:
                        aa = a2 + ((au2j if tdj == b else auj) if ts else (auj if PD[b] else 0))
                        ll = lt + luj
                    if not volume_terms:
                        volume_terms = True
                        A = XS // (kf * k)
                        C2 = kc * ko
                        x1 = PE + A // kc - 2 * (A // (kc * kp))
                        x2 = PE + A // C2 - 2 * (A // (C2 * kp))
                    v = x1 + ko * aa
                    if x2 + aa < v:
                        v = x2 + aa
                    push(pq, (g2 + (v * hmul if v > 0 else 0) + ll, -g2, s2))


def clear_caches() -> None:
    """Forget the cycle costs kept across searches."""
    clear_cycle_caches()
