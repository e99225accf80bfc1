"""One collective over a flattened group of mesh dims where it beats one collective per mesh dim.

The search (``search.py``) moves one mesh dim per step.  Under the ring model a collective
over the flattened group of several mesh dims never moves fewer bytes than the per-dim steps
it replaces (equal when the pieces are even, more when padding grows), and it has more ring
hops (``K-1`` against ``sum(k_j-1)``).  What it saves is collectives: one launch instead of
two or three, which is what dominates small and medium tensors on real transports.  So the
choice is made here, on the planner's own objective (bandwidth time first, exact), with the
per-collective ``launch`` cost of ``cost.LinkModel`` deciding among equal-byte plans:

* **merges**: consecutive steps of one kind become one ``FlatStep``: all-gathers popping the
  top of one shard list (``(S0,S0) -> (R,R)``: one all-gather over 4 ranks), all-reduces of
  the same partial kind.  Reduce-scatters stay per mesh dim (two on ``(P,P) -> (S0,S0)``; the
  executor can run a flattened one, ``FlatStep(P -> S(d))``);
* **all-reduce first**: partial mesh dims of one kind whose target is ``R`` are reduced by one
  all-reduce over their flattened group, and the rest is planned from there.  ``(P,P) -> (R,R)``
  on a (2,2) mesh: the best per-dim plan is reduce-scatter, all-reduce, all-gather (three
  collectives, 1.5 |X|); one all-reduce over 4 ranks moves the same 1.5 |X|.

* **direct plan** (``exchange.py``): the plan may be replaced by one all-to-all over the
  flattened group of the changing mesh dims that sends each peer exactly the part of its block
  the peer needs (``(S0,S0) -> (R,S0)``: 2/4 of the tensor per rank instead of 2.5/4), after
  reduce-scatters of the source's partials that must go.  Its bytes also cap the search
  (``ceiling_applies``).

A candidate replaces the per-dim plan only if it moves less bandwidth time, or the same and is
strictly cheaper in latency plus launches, so the search's byte optimality is kept.
"""
from __future__ import annotations

import math

from ..placement import Placement, Replicate, Shard
from .cost import link_of, step_comm
from .exchange import exchange_bound, exchange_comm, exchange_dims, exchange_floor, exchange_lack
from .search import LOWER, search
from .steps import ExchangeStep, FlatStep, Step

__all__ = ["improve", "merge_steps", "direct_plan", "ceiling_applies"]


def improve(base: tuple[Step, ...], mesh_shape, links, src, src_order, dst, dst_order, shape,
            itemsize: int, direct: tuple[Step, ...] | None) -> tuple[Step, ...]:
    """``base`` (the per-dim optimum), or a plan with flattened-group collectives or the direct
    plan (``direct_plan``, passed in) where that moves fewer bytes, or the same bytes in fewer
    collectives."""
    groups = _reduce_groups(src, dst, mesh_shape)
    ncoll = sum(1 for st in base if step_comm(st, shape, mesh_shape)[3])
    if not ncoll:
        direct = None
    joins = ncoll > 1 and any(_join(a, b) is not None for a, b in zip(base, base[1:]))
    if not groups and not joins and direct is None:
        return base  # nothing to join, nothing to replace: no pricing at all
    score = _Scorer(shape, mesh_shape, itemsize, links)
    best, best_score = base, score.plan(base)

    def offer(cand: tuple[Step, ...], sc=None) -> None:
        nonlocal best, best_score
        sc = score.plan(cand) if sc is None else sc
        if sc < best_score:
            best, best_score = cand, sc

    merged = merge_steps(base, shape, mesh_shape, itemsize, links, score)
    if merged is not base:
        offer(merged)
    for group in groups:
        first = FlatStep(group[0], src[group[0]], Replicate(), src, src_order, dims=group)
        if score.plan((first,))[0] > best_score[0]:
            continue  # the all-reduce alone moves more than the whole best plan: no second search
        mid = tuple(Replicate() if j in group else p for j, p in enumerate(src))
        rest, _ = search(mesh_shape, links, mid, src_order, dst, dst_order, shape)
        assert rest is not None  # no ceiling: the search always answers
        cand = (first,) + rest
        offer(cand)
        m2 = merge_steps(cand, shape, mesh_shape, itemsize, links, score)
        if m2 is not cand:
            offer(m2)
    if direct is not None:
        offer(direct, _direct_score(score, best_score, mesh_shape, direct, shape))
    return best


def direct_plan(mesh_shape, src, src_order, dst, dst_order, shape) -> tuple[Step, ...] | None:
    """The direct plan: every partial that must go is reduce-scattered (onto its target's tensor
    dim, or the longest one for a Replicate target), then one direct exchange does the rest.
    ``None`` where the exchange does not apply (a partial kind change, one mesh dim left to
    change, a mesh over ``exchange.MAX_RANKS`` ranks, a 0-d tensor with partials)."""
    pre: list[Step] = []
    cur, lists = list(src), dict(src_order)
    order = src_order
    for j, (a, b) in enumerate(zip(src, dst)):
        if not a.is_partial() or a == b or mesh_shape[j] == 1:
            continue
        if b.is_partial() or not shape:
            return None
        d = b.dim if b.is_shard() else max(range(len(shape)), key=lambda e: (shape[e], -e))
        pre.append(Step(j, a, Shard(d), tuple(cur), order))
        cur[j] = Shard(d)
        lists[d] = lists.get(d, ()) + (j,)
        order = tuple(sorted(lists.items()))
    mid = tuple(cur)
    dims = exchange_dims(mid, order, dst, dst_order, mesh_shape)
    if dims is None:
        return None
    return tuple(pre) + (ExchangeStep(dims[0], mid[dims[0]], dst[dims[0]], mid, order, dims=dims, target=dst,
                                      target_order=dst_order),)


def direct_elements(steps: tuple[Step, ...], mesh_shape, shape, kind: str) -> int:
    """Elements per rank the direct plan moves: its reduce-scatters, then ``_exchange_elements``
    of its exchange (exact, or a bound of it, by ``kind``)."""
    pre, ex = steps[:-1], steps[-1]
    assert isinstance(ex, ExchangeStep)
    total = 0
    for st in pre:
        _, num, den, _ = step_comm(st, shape, mesh_shape)
        assert den == 1, st
        total += num
    return total + _exchange_elements(ex, mesh_shape, shape, kind)


def _exchange_elements(ex: ExchangeStep, mesh_shape, shape, kind: str) -> int:
    """Elements per rank the exchange moves (its busiest rank) if ``kind`` is ``"exact"``, else a
    cheap ``"upper"`` bound of them, or a lower one: what the rank at coordinate 0 lacks
    (``"first"``, no array work) or the busiest receiver (``"lower"``, a pass over the ranks)."""
    a = (ex.placements, ex.order, ex.target, ex.target_order)
    if kind == "exact":
        return exchange_comm(shape, mesh_shape, ex.dims, *a)[0]
    if kind == "upper":
        return exchange_bound(shape, mesh_shape, ex.dims, *a)
    if kind == "first":
        return exchange_lack(shape, mesh_shape, *a)
    if kind == "lower":
        return exchange_floor(shape, mesh_shape, ex.dims, *a)
    raise ValueError(f"kind must be 'exact', 'upper', 'first' or 'lower', got {kind!r}")


def ceiling_applies(links, src, dst, mesh_shape) -> bool:
    """Whether no plan of ``improve`` other than the direct one can move fewer bytes than the
    per-dim optimum, so a search may stop once it proves every per-dim plan moves more than the
    direct plan.  Flattened all-gathers never move fewer bytes; what could is two all-reduces of
    one partial kind joined into one (and the all-reduce-first plans), so at most one mesh dim
    may hold each partial kind.  The links must share one bandwidth (the search's units)."""
    if len({lk.beta for lk in links}) != 1 or not links[0].beta:
        return False
    kinds = [a for j, a in enumerate(src) if a.is_partial() and mesh_shape[j] > 1]
    return len(kinds) == len(set(kinds))


def _direct_score(score: "_Scorer", best_score: tuple, mesh_shape, steps: tuple[Step, ...], shape) -> tuple:
    """The direct plan's score.  The exchange is priced first on a cheap upper bound; when that
    does not win, on the search's lower bounds in turn (``search.LOWER``), cheapest first, until
    one rules it out or the last, the exact busiest rank (a pass over the pairs that may
    exchange), prices it."""
    pre, ex = steps[:-1], steps[-1]
    assert isinstance(ex, ExchangeStep)
    pre_bw, pre_t = score.plan(pre)
    lat = math.prod(mesh_shape[j] for j in ex.dims) - 1

    def total(kind: str) -> tuple:
        bw, t = score.raw(ex.dims, _exchange_elements(ex, mesh_shape, shape, kind), 1, lat)
        return pre_bw + bw, pre_t + t

    ub = total("upper")
    if ub < best_score:
        return ub
    for kind in LOWER[:-1]:
        if total(kind) >= best_score:
            return ub  # a lower bound already loses
    return total(LOWER[-1])


class _Scorer:
    """The planner's objective, fast: ``(bandwidth, latency + launches)``.  Bandwidth is an exact
    integer (bytes x the mesh size, which every all-reduce denominator divides) when every
    link has the same beta, so equal-byte plans tie exactly."""

    def __init__(self, shape, mesh_shape, itemsize, links) -> None:
        self.shape, self.mesh_shape, self.itemsize, self.links = shape, mesh_shape, itemsize, links
        self.D = math.prod(mesh_shape)
        self.same_beta = len({lk.beta for lk in links}) == 1
        self.uniform = links[0] if len(set(links)) == 1 else None
        self.memo: dict[int, tuple] = {}  # id(step) -> (score, step); the step is kept so the id stays its own

    def raw(self, dims, num: int, den: int, lat: int) -> tuple:
        units = num * self.itemsize * (self.D // den)
        lk = self.uniform or link_of(dims, self.links)
        bw = units if self.same_beta else lk.beta * units
        return bw, (lk.launch + lat * lk.alpha) if lat else 0.0

    def step(self, st: Step) -> tuple:
        """One step's score, memoised for the call (candidates share most of their steps)."""
        key = id(st)
        hit = self.memo.get(key)
        if hit is None:
            _, num, den, lat = step_comm(st, self.shape, self.mesh_shape)
            hit = self.memo[key] = (self.raw(st.mesh_dims, num, den, lat) if lat else (0, 0.0), st)
        return hit[0]

    def plan(self, steps) -> tuple:
        bw, t = 0, 0.0
        for st in steps:
            b, x = self.step(st)
            bw += b
            t += x
        return bw, t


def _reduce_groups(src, dst, mesh_shape) -> list[tuple[int, ...]]:
    """Mesh dims of one partial kind, all headed for Replicate (two or more, each of size > 1)."""
    by_kind: dict[Placement, list[int]] = {}
    for j, (a, b) in enumerate(zip(src, dst)):
        if a.is_partial() and b.is_replicate() and mesh_shape[j] > 1:
            by_kind.setdefault(a, []).append(j)
    return [tuple(js) for js in by_kind.values() if len(js) > 1]


def _kind(st: Step) -> str:
    a, b = st.src, st.dst
    if a.is_shard() and b.is_replicate():
        return "ag"
    if a.is_partial() and b.is_replicate():
        return "ar"
    return ""


def _join(a: Step, b: Step) -> FlatStep | None:
    """``a`` then ``b`` as one collective over the flattened group, if they form one."""
    ka = _kind(a)
    if not ka or ka != _kind(b) or a.src != b.src or a.dst != b.dst:
        return None
    if ka == "ag":
        # b pops the new top of the same list: group order is the list order (b's dim first)
        dims = (b.mesh_dim,) + a.mesh_dims
    else:
        dims = a.mesh_dims + (b.mesh_dim,)
    return FlatStep(dims[0], a.src, a.dst, a.placements, a.order, dims=dims)


def merge_steps(steps: tuple[Step, ...], shape, mesh_shape, itemsize: int, links,
                scorer: "_Scorer | None" = None) -> tuple[Step, ...]:
    """Join runs of consecutive steps into flattened collectives where that is cheaper.

    Returns ``steps`` itself when nothing changes.
    """
    score = scorer or _Scorer(shape, mesh_shape, itemsize, links)
    if len(steps) < 2:
        return steps
    out: list[Step] = [steps[0]]
    changed = False
    for st in steps[1:]:
        prev = out[-1]
        if isinstance(st, FlatStep) or mesh_shape[st.mesh_dim] == 1 or any(mesh_shape[i] == 1 for i in prev.mesh_dims):
            out.append(st)
            continue
        j = _join(prev, st)
        if j is not None:
            old = score.plan((prev, st))
            new = score.plan((j,))
            if new[0] <= old[0] and new[1] < old[1]:
                out[-1] = j
                changed = True
                continue
        out.append(st)
    return tuple(out) if changed else steps
