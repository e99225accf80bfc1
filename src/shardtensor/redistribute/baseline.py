"""The baseline plan: undo what must change, then build the target.  Always correct, never cheap.

The search (``search.py``) returns it when it gives up (expansion cap), and the tests use it as
the bound the search must never exceed.  Phases: (1) pop, last-applied first, every mesh dim
that shards a tensor dim beyond the prefix shared with the target order -- straight to its
target shard by all-to-all when it lands in place, else to Replicate; (2) append the target
shards in target order (chunk from Replicate, reduce-scatter from Partial); (3) reduce the
remaining partials; (4) partition.
"""
from __future__ import annotations

from ..placement import Placement, Replicate, Shard, ShardOrder, shard_dim
from .steps import Step

__all__ = ["baseline_plan"]


def _freeze(order: dict[int, list[int]]) -> ShardOrder:
    return tuple((d, tuple(js)) for d, js in sorted(order.items()) if js)


def baseline_plan(src: tuple[Placement, ...], src_order: ShardOrder, dst: tuple[Placement, ...],
                  dst_order: ShardOrder) -> tuple[Step, ...]:
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
            e = shard_dim(t)
            lands = (e is not None and e != d and len(order.get(e, [])) == keep[e]
                     and len(tgt[e]) > keep[e] and tgt[e][keep[e]] == j)
            new = t if lands else Replicate()
            steps.append(Step(j, cur[j], new, tuple(cur), _freeze(order)))
            cur[j] = new
            lst.pop()
            if lands:
                assert e is not None
                order.setdefault(e, []).append(j)
                keep[e] += 1

    for d in sorted(tgt):
        for j in tgt[d][len(order.get(d, [])):]:
            assert not cur[j].is_shard(), (src, dst, cur)
            steps.append(Step(j, cur[j], Shard(d), tuple(cur), _freeze(order)))
            cur[j] = Shard(d)
            order.setdefault(d, []).append(j)

    for j, (c, t) in enumerate(zip(cur, dst)):
        if c.is_partial() and c != t:
            if c.rescales_to(t):
                emit(j, t)
            else:
                emit(j, Replicate())
    for j, (c, t) in enumerate(zip(cur, dst)):
        if c != t:
            assert c.is_replicate() and t.is_partial(), (src, dst, cur)
            emit(j, t)
    assert tuple(cur) == tuple(dst) and _freeze(order) == tuple(dst_order), (src, src_order, dst, dst_order, cur, order)
    return tuple(steps)
