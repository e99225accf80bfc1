"""One collective over a flattened group of mesh dims where it beats one collective per mesh dim.

The search in ``optimal.py`` moves one mesh dim per step.  Under the ring model a collective
over the flattened group of several mesh dims never moves fewer bytes than the per-dim steps
it replaces (equal when the pieces are even, more when padding grows), and it has more ring
hops (``K-1`` against ``sum(k_j-1)``).  What it saves is collectives: one launch instead of
two or three, which is what dominates small and medium tensors on real transports.  So the
choice is made here, on the planner's own objective (bandwidth time first, exact), with the
per-collective ``launch`` cost of ``cost.LinkModel`` deciding among equal-byte plans:

* **merges**: consecutive steps of one kind become one ``FlatStep``: all-gathers popping the
  top of one shard list (``(S0,S0) -> (R,R)``: one all-gather over 4 ranks), all-reduces of
  the same partial kind.  Reduce-scatters stay per mesh dim (spec row 19 asks for two on
  ``(P,P) -> (S0,S0)``; the executor can run a flattened one, ``FlatStep(P -> S(d))``);
* **all-reduce first**: partial mesh dims of one kind whose target is ``R`` are reduced by one
  all-reduce over their flattened group, and the rest is planned from there.  ``(P,P) -> (R,R)``
  on a (2,2) mesh: the best per-dim plan is reduce-scatter, all-reduce, all-gather (three
  collectives, 1.5 |X|); one all-reduce over 4 ranks moves the same 1.5 |X|.

* **direct exchange** (``exchange.py``): a multi-collective plan between specs with no partial
  on the changing mesh dims may be replaced by one all-to-all over their flattened group that
  sends each peer exactly the part of its block the peer needs (``(S0,S0) -> (R,S0)``: 2/4 of
  the tensor per rank instead of 2.5/4).

A candidate replaces the per-dim plan only if it moves less bandwidth time, or the same and is
strictly cheaper in latency plus launches, so the byte optimality of ``optimal.py`` is kept.  Plans are
cached with the same key as the optimal planner's.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from ..placement import Partial, Placement, Replicate, Shard, ShardOrder
from .cost import LinkModel, normalize_links, plan_score
from .optimal import _norm_order, optimal_plan
from .exchange import exchange_dims
from .planner import ExchangeStep, FlatStep, Step

__all__ = ["best_plan", "merge_steps", "clear_cache"]


def best_plan(src: Sequence[Placement], src_order: ShardOrder, dst: Sequence[Placement], dst_order: ShardOrder,
              global_shape: Sequence[int], mesh_shape: Sequence[int], itemsize: int,
              links: LinkModel | Sequence[LinkModel] | None = None) -> tuple[Step, ...]:
    """The optimal per-dim plan, with flattened-group collectives where they are cheaper."""
    mesh_shape = tuple(int(k) for k in mesh_shape)
    return _cached(mesh_shape, normalize_links(links, len(mesh_shape)), tuple(src), _norm_order(src_order),
                   tuple(dst), _norm_order(dst_order), tuple(int(n) for n in global_shape), int(itemsize))


def clear_cache() -> None:
    _cached.cache_clear()


@lru_cache(maxsize=8192)
def _cached(mesh_shape, links, src, src_order, dst, dst_order, shape, itemsize) -> tuple[Step, ...]:
    base = optimal_plan(src, src_order, dst, dst_order, shape, mesh_shape, itemsize, links)
    cands = [base]
    merged = merge_steps(base, shape, mesh_shape, itemsize, links)
    if merged is not base:
        cands.append(merged)
    for group in _reduce_groups(src, dst, mesh_shape):
        first = FlatStep(group[0], src[group[0]], Replicate(), src, src_order, dims=group)
        mid = tuple(Replicate() if j in group else p for j, p in enumerate(src))
        rest = optimal_plan(mid, src_order, dst, dst_order, shape, mesh_shape, itemsize, links)
        cand = (first,) + rest
        cands.append(cand)
        m2 = merge_steps(cand, shape, mesh_shape, itemsize, links)
        if m2 is not cand:
            cands.append(m2)
    if sum(1 for st in base if st.collective not in _LOCAL) > 1:
        dims = exchange_dims(src, src_order, dst, dst_order, mesh_shape)
        if dims is not None:
            cands.append((ExchangeStep(dims[0], src[dims[0]], dst[dims[0]], src, src_order, dims=dims, target=dst,
                                       target_order=dst_order),))
    if len(cands) == 1:
        return base
    best, best_score = base, plan_score(base, shape, mesh_shape, itemsize, links)
    for c in cands[1:]:
        sc = plan_score(c, shape, mesh_shape, itemsize, links)
        if sc[0] < best_score[0] or (sc[0] == best_score[0] and sc[1] < best_score[1]):
            best, best_score = c, sc
    return best


_LOCAL = ("identity", "chunk", "partition", "rescale")


def _reduce_groups(src, dst, mesh_shape) -> list[tuple[int, ...]]:
    """Mesh dims of one partial kind, all headed for Replicate (two or more, each of size > 1)."""
    by_kind: dict[Placement, list[int]] = {}
    for j, (a, b) in enumerate(zip(src, dst)):
        if isinstance(a, Partial) and isinstance(b, Replicate) and mesh_shape[j] > 1:
            by_kind.setdefault(a, []).append(j)
    return [tuple(js) for js in by_kind.values() if len(js) > 1]


def _kind(st: Step) -> str:
    a, b = st.src, st.dst
    if isinstance(a, Shard) and isinstance(b, Replicate):
        return "ag"
    if isinstance(a, Partial) and isinstance(b, Replicate):
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


def merge_steps(steps: tuple[Step, ...], shape, mesh_shape, itemsize: int, links) -> tuple[Step, ...]:
    """Join runs of consecutive steps into flattened collectives where that is cheaper.

    Returns ``steps`` itself when nothing changes.
    """
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
            old = plan_score((prev, st), shape, mesh_shape, itemsize, links)
            new = plan_score((j,), shape, mesh_shape, itemsize, links)
            if new[0] <= old[0] and new[1] < old[1]:
                out[-1] = j
                changed = True
                continue
        out.append(st)
    return tuple(out) if changed else steps
