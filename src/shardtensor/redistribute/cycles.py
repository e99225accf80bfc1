"""The waiting-cycle term of the planner search's bound (``search.py``; docs/redistribution.md,
"How the planner searches"): misplaced shards that each sit on another's target list."""
from __future__ import annotations

from functools import lru_cache
from itertools import permutations

__all__ = ["cycle_extra", "feedback_cost", "clear_caches"]


def cycle_extra(edges: list[tuple[int, int, int]]) -> int:
    """Cheapest set of extra moves that breaks every waiting cycle among misplaced shards.

    A misplaced shard whose target is a shard on another tensor dim is an edge from the tensor
    dim it sits on to its target dim (``decode`` lists them): every shard sitting on its target
    list must leave before it arrives.  In a cycle no member can make its first move its final
    one, so one member moves twice: the extra cost is that of the cheapest edges whose removal
    leaves no cycle.
    """
    if len(edges) == 2:  # the common case: a cycle only if the two swap places
        (a, b, w), (c, d, x) = edges
        return (w if w < x else x) if a == d and b == c else 0
    return feedback_cost(tuple(edges)) if len(edges) > 1 else 0


@lru_cache(maxsize=4096)
def feedback_cost(edges: tuple[tuple[int, int, int], ...]) -> int:
    """The least total weight of ``(tail, head, weight)`` edges whose removal leaves no directed
    cycle.  A graph is acyclic exactly when some order of its nodes sends every edge forwards, so
    this is the least weight sent backwards over the orders of the nodes that can lie on a cycle
    (those left after repeatedly dropping nodes with no incoming or no outgoing edge; a search
    has at most one edge per mesh dim, so a handful)."""
    live = edges
    while True:
        tails, heads = {e[0] for e in live}, {e[1] for e in live}
        core = tuple(e for e in live if e[0] in heads and e[1] in tails)
        if len(core) == len(live):
            break
        live = core
    if not live:
        return 0
    weight: dict[tuple[int, int], int] = {}
    for a, b, w in live:
        weight[a, b] = weight.get((a, b), 0) + w
    if len(tails) == 2:  # two nodes: one direction goes
        return min(weight.values())
    pairs = list(weight.items())
    return min(sum(w for (a, b), w in pairs if rank[a] > rank[b])
               for rank in ({d: i for i, d in enumerate(order)} for order in permutations(sorted(tails))))


def clear_caches() -> None:
    """Forget the cycle costs kept across searches."""
    feedback_cost.cache_clear()
