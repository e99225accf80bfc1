"""Propagation: (op, input specs, static args) -> Decision, from the rule, cached.

The cache key is cheap and hashable: the op, the call's structure, each DTensor's spec and each
other argument frozen (scalars by type and sign for ops whose decision depends on nothing more).
An op without a rule raises ``UnsupportedOpError`` naming the op and the input placements.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Any, Sequence

import torch

from ..errors import MeshMismatchError, PropagationError, ShardingError
from ..observe import LISTENERS, deciding, note
from ..spec import DTensorSpec, placements_text
from .call import Call, Decision
from .registry import _BY_SIGN, needs_of, rule_for, unsupported
from .strategy import Candidate, decide

__all__ = ["propagate", "freezer", "clear_cache", "cache_info", "one_mesh", "HOT", "HOT_HITS", "remember"]


class _LRU:
    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.data: OrderedDict = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key):
        v = self.data.get(key)
        if v is None:
            self.misses += 1
            return None
        try:
            self.data.move_to_end(key)
        except KeyError:  # evicted by another simulated rank meanwhile
            pass
        self.hits += 1
        return v

    def put(self, key, value) -> None:
        self.data[key] = value
        if len(self.data) > self.maxsize:
            self.data.popitem(last=False)


_cache = _LRU(4096)

HOT: dict[tuple, tuple] = {}
"""The dispatcher's hit path (``dispatch/hit.py``): ``(op id, [treedef,] per argument its spec's id,
a tensor list's length and ids, or its frozen value)`` -> ``(decision, the specs)``.  Holding the specs keeps their ids from being
reused while the entry lives; cleared with the main cache, and whole when it holds ``_cache.maxsize``."""


class _Hits:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


HOT_HITS = _Hits()


def clear_cache(maxsize: int | None = None) -> None:
    """Forget every cached decision (and the counters)."""
    global _cache
    _cache = _LRU(maxsize or _cache.maxsize)
    HOT.clear()
    HOT_HITS.n = 0


def remember(key: tuple, decision: Decision, specs: tuple, kernel: Any) -> tuple:
    """Keep ``decision`` for the hit path under ``key`` (``specs``: the specs whose ids it holds;
    ``kernel``: what runs it on local tensors)."""
    if len(HOT) >= _cache.maxsize:
        HOT.clear()
    entry = HOT[key] = (decision, specs, kernel)
    return entry


def cache_info() -> dict[str, int]:
    """Hits (both paths), misses, sizes and the bound of the decision cache."""
    return {"hits": _cache.hits + HOT_HITS.n, "misses": _cache.misses, "size": len(_cache.data),
            "hot_size": len(HOT), "maxsize": _cache.maxsize}


def _sign(v: Any) -> Any:
    if isinstance(v, (bool, int, float)):
        if v != v:
            return (type(v), "nan")
        return (type(v), (v > 0) - (v < 0))
    if isinstance(v, complex):
        return (complex,)
    return _freeze(v)


def _freeze(v: Any) -> Any:
    if isinstance(v, (bool, int, float, complex)):
        if isinstance(v, float) and math.isnan(v):
            return (float, "nan")
        return (type(v), v)
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.device)
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    return v


def freezer(op) -> Any:
    """How ``op``'s non-tensor arguments enter a cache key: by type and sign for ops registered
    with ``scalars_by_sign``, else by value."""
    return _sign if id(op) in _BY_SIGN else _freeze


def propagate(op, flat: list[Any], specs: list[DTensorSpec | None], treedef) -> Decision:
    """The decision for one call, from the cache when the same signature was seen before."""
    fr = freezer(op)
    key: tuple | None = (id(op), treedef, tuple(s if s is not None else fr(a) for a, s in zip(flat, specs)))
    try:
        d = _cache.get(key)
    except TypeError:  # symbolic sizes (torch.compile replaying a view on fake tensors): decided, not cached
        d = key = None
    if d is not None:
        return d
    one_mesh(op, specs)
    if any(s is not None and s.opaque for s in specs):  # the dispatcher gathers them first
        raise PropagationError(f"shardtensor: no sharding rule reads these placements ({op}, input placements: "
                               f"{placements_text(specs)}); dispatch gathers its mesh dims first")
    rule = rule_for(op)
    if rule is None:
        raise unsupported(op, specs)
    call = Call(op, flat, specs, treedef)
    t0 = time.perf_counter() if LISTENERS else 0.0
    try:
        with deciding():
            call.need(needs_of(op))
            d = rule(call)
    except (ShardingError, NotImplementedError):
        raise
    except RuntimeError as e:  # torch's own checks, met while the rule evaluated metadata
        raise PropagationError(f"shardtensor: sharding propagation failed on {op} "
                               f"(input placements: {placements_text(specs)}): {e}") from e
    if isinstance(d, (list, Candidate)):
        d = decide(call, d)
    if not isinstance(d, Decision):
        raise ValueError(f"shardtensor: rule of {op} returned {type(d).__name__}, expected a Decision or candidates")
    if key is not None:
        _cache.put(key, d)
    if LISTENERS:
        note("decide", op, time.perf_counter() - t0)
    return d


def one_mesh(op: Any, specs: Sequence[DTensorSpec | None]) -> Any:
    """The mesh every DTensor operand of ``op`` lives on; ``MeshMismatchError`` when they differ."""
    mesh = None
    for s in specs:
        if s is not None:
            if mesh is None:
                mesh = s.mesh
            elif s.mesh != mesh:
                raise MeshMismatchError(f"{op}: cross-mesh operation, operands live on different meshes "
                                        f"{mesh!r} and {s.mesh!r}")
    return mesh
