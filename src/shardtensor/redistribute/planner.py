"""The planner's one entry: the cheapest plan between two specs, cached.

``plan`` runs the search (``search.py``: the cheapest per-mesh-dim plan), then ``flatten.improve``
(one collective over several mesh dims where that is cheaper).  The result depends only on its
arguments, never on the rank, so every rank runs the same collectives.

The cache is keyed so that a training run rarely plans: the plan depends on a tensor dim's length
only through its padded pieces and the order of the lengths, so lengths that every product of
mesh sizes divides (evenly split however the dim is sharded) plan the same way as the least such
lengths in the same order, and share their key; so do all itemsizes.  Exact lengths stay in the
key for the other dims, and everything stays in it when the mesh dims' links differ in bandwidth
(floating-point prices could then tie differently).
"""
from __future__ import annotations

import math
import time
from functools import lru_cache, partial
from typing import Sequence

from ..observe import LISTENERS, note
from ..placement import Placement, ShardOrder, all_planned
from .cost import LinkModel, normalize_links
from .flatten import ceiling_applies, direct_elements, direct_plan, improve
from .exchange import clear_caches as clear_exchange_caches
from .search import clear_caches as clear_search_caches
from .search import search
from .steps import Step

__all__ = ["plan", "plan_for", "plan_uncached", "per_dim_plan", "norm_order", "clear_cache", "cache_info", "CACHE_SIZE"]

CACHE_SIZE = 8192

# (mesh shape, links, src, src order, dst, dst order, global shape), normalised
_Args = tuple[tuple[int, ...], tuple[LinkModel, ...], tuple, ShardOrder, tuple, ShardOrder, tuple[int, ...]]
# the same, then the itemsize: the plan cache's key
_Key = tuple[tuple[int, ...], tuple[LinkModel, ...], tuple, ShardOrder, tuple, ShardOrder, tuple[int, ...], int]


def plan(src: Sequence[Placement], src_order: ShardOrder, dst: Sequence[Placement], dst_order: ShardOrder,
         global_shape: Sequence[int], mesh_shape: Sequence[int], itemsize: int = 4,
         links: LinkModel | Sequence[LinkModel] | None = None) -> tuple[Step, ...]:
    """The steps ``redistribute`` runs from ``(src, src_order)`` to ``(dst, dst_order)``.

    ``links``: one ``LinkModel`` per mesh dim (or one for all; ``None``: the default), which
    prices bandwidth first, then latency and launches.  Raises ``ValueError`` on specs whose
    placements and shard order disagree.
    """
    return _cached(*_key(src, src_order, dst, dst_order, global_shape, mesh_shape, itemsize, links))


def plan_for(src_spec, dst_spec) -> tuple[Step, ...]:
    """``plan`` between two ``DTensorSpec``s of one mesh."""
    return plan(src_spec.placements, src_spec.shard_order, dst_spec.placements, dst_spec.shard_order,
                src_spec.shape, src_spec.mesh.shape, max(src_spec.dtype.itemsize, 1))


def plan_uncached(src, src_order, dst, dst_order, global_shape, mesh_shape, itemsize: int = 4, links=None,
                  stats: dict | None = None, shape_class: bool = True) -> tuple[Step, ...]:
    """``plan`` without the cache: what a miss of ``plan`` computes (benchmarks, tests); ``stats``
    receives the search's counters.  ``shape_class=False`` plans on the exact shape (tests)."""
    if shape_class:
        return _plan(*_key(src, src_order, dst, dst_order, global_shape, mesh_shape, itemsize, links), stats)
    return _plan(*_normalized(src, src_order, dst, dst_order, global_shape, mesh_shape, links), int(itemsize), stats)


def per_dim_plan(src: Sequence[Placement], src_order: ShardOrder, dst: Sequence[Placement], dst_order: ShardOrder,
                 global_shape: Sequence[int], mesh_shape: Sequence[int],
                 links: LinkModel | Sequence[LinkModel] | None = None) -> tuple[Step, ...]:
    """The search's plan alone (one mesh dim per step, before ``flatten.improve``), uncached."""
    steps, _ = search(*_normalized(src, src_order, dst, dst_order, global_shape, mesh_shape, links))
    assert steps is not None  # no ceiling: the search always answers
    return steps


def _key(src, src_order, dst, dst_order, global_shape, mesh_shape, itemsize, links) -> _Key:
    """``_plan``'s arguments as ``plan`` caches them: normalised, and on the shape class with
    itemsize 1 when every mesh dim's link has one bandwidth (else the exact shape and itemsize)."""
    ms, lk, a, a_order, b, b_order, shape = _normalized(src, src_order, dst, dst_order, global_shape, mesh_shape,
                                                        links)
    if len({x.beta for x in lk}) <= 1:
        return ms, lk, a, a_order, b, b_order, _shape_class(shape, ms), 1
    return ms, lk, a, a_order, b, b_order, shape, int(itemsize)


def _normalized(src, src_order, dst, dst_order, global_shape, mesh_shape, links) -> _Args:
    """The arguments as the search takes them: tuples of ints, links per mesh dim, sorted orders."""
    if not (all_planned(src) and all_planned(dst)):  # ``move.redistribute_local`` exchanges blocks instead
        raise NotImplementedError(f"plans of collectives are between Shard, Replicate and Partial ({tuple(src)} -> "
                                  f"{tuple(dst)}): a placement the planner does not move goes by an exchange of "
                                  "blocks (shardtensor.redistribute.move.plan_move prints it)")
    mesh_shape = tuple(map(int, mesh_shape))
    return (mesh_shape, normalize_links(links, len(mesh_shape)), tuple(src), norm_order(src_order), tuple(dst),
            norm_order(dst_order), tuple(map(int, global_shape)))


def _plan(mesh_shape, links, src, src_order, dst, dst_order, shape, itemsize, stats=None) -> tuple[Step, ...]:
    """The search's plan, then ``flatten.improve``; ``stats`` receives the search's counters.

    The search is capped at the direct plan's bytes where that is sound (``flatten.ceiling_applies``):
    once it proves that every per-dim plan moves more, it stops, and the direct plan is the plan,
    as ``improve`` would have chosen (fewer bytes first).  When instead its plan moves less than a
    lower bound of the direct plan it asked for, ``improve`` is not offered the direct plan."""
    t0 = time.perf_counter() if LISTENERS else 0.0
    direct = direct_plan(mesh_shape, src, src_order, dst, dst_order, shape)
    ceiling = None
    if direct is not None and ceiling_applies(links, src, dst, mesh_shape):
        ceiling = partial(direct_elements, direct, mesh_shape, shape)
    base, info = search(mesh_shape, links, src, src_order, dst, dst_order, shape, ceiling)
    if stats is not None:
        stats.update(info)
    if base is None:
        assert direct is not None
        steps = direct
    else:
        if info.get("other_loses"):
            direct = None  # the search proved it moves more: improve need not price it
        steps = improve(base, mesh_shape, links, src, src_order, dst, dst_order, shape, itemsize, direct)
    if LISTENERS:
        note("plan", None, time.perf_counter() - t0)
    return steps


_cached = lru_cache(maxsize=CACHE_SIZE)(_plan)


def clear_cache() -> None:
    """Forget every cached plan, and the exchange prices and cycle costs the planner kept."""
    _cached.cache_clear()
    clear_exchange_caches()
    clear_search_caches()


def cache_info():
    """Hits, misses and size of the plan cache (``functools`` cache info)."""
    return _cached.cache_info()


@lru_cache(maxsize=1024)
def _shape_class(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with every length that the whole mesh divides, at least twice, replaced by the
    least such length that keeps the order of all the lengths (ties included): such a dim is
    split evenly by every set of mesh dims and never down to one element, so every cost the
    planner compares scales by the same factor, and choices made by comparing lengths (the
    direct plan reduce-scatters onto the longest dim) come out the same."""
    K = math.prod(mesh_shape)
    short: dict[int, int] = {}
    prev = 0
    for n in sorted(set(shape)):
        if n > K and n % K == 0:
            short[n] = prev = max(2 * K, (prev // K + 1) * K)
        else:
            prev = n
    return tuple(short.get(n, n) for n in shape)


def norm_order(order) -> ShardOrder:
    """Sorted ``((tensor dim, (mesh dims...)), ...)`` with plain ints (a no-op for normal orders)."""
    if type(order) is tuple:
        prev = -1
        for e in order:
            if type(e) is not tuple or len(e) != 2 or type(e[0]) is not int or e[0] <= prev or type(e[1]) is not tuple:
                break
            prev = e[0]
        else:
            return order
    return tuple(sorted((int(d), tuple(js)) for d, js in order))
