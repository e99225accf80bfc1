"""Sharding propagation: (op, input specs, static args) -> Decision, cached.

A rule is a function ``rule(call: Call) -> Decision`` registered for an op overload (or
found by op tag, e.g. every ``pointwise`` op).  The propagator builds the call, computes
output metadata on meta tensors, asks the rule, and caches the decision under a cheap
hashable key.  An op without a rule raises ``NotImplementedError`` naming the op and the
input placements; nothing falls back to replicating silently.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..placement import display
from ..spec import DTensorSpec

__all__ = ["Call", "Decision", "register", "propagate", "RULES", "TAG_RULES", "clear_cache", "cache_info", "unsupported"]


@dataclass(frozen=True)
class Decision:
    """What a rule decided: required spec per flat argument (None = leave it) and output spec(s)."""

    inputs: tuple[DTensorSpec | None, ...]
    output: Any
    redistribute: bool
    local_args: Callable[[list[Any]], list[Any]] | None = None
    """Per-rank rewrite of the flat local arguments (e.g. global sizes -> this rank's local sizes)."""


@dataclass
class Call:
    """One op call as the rules see it: flat args, their specs (None for non-DTensors), output meta."""

    op: torch._ops.OpOverload
    flat: list[Any]
    specs: list[DTensorSpec | None]
    treedef: Any
    out_meta: Any

    @property
    def tensor_positions(self) -> list[int]:
        return [i for i, s in enumerate(self.specs) if s is not None]

    @property
    def mesh(self):
        return self.specs[self.tensor_positions[0]].mesh

    def args_kwargs(self) -> tuple[tuple, dict]:
        return tree_unflatten(self.flat, self.treedef)


Rule = Callable[[Call], Decision]
RULES: dict[Any, Rule] = {}
TAG_RULES: list[tuple[torch.Tag, Rule]] = []


def register(*ops: Any) -> Callable[[Rule], Rule]:
    """Decorator: ``@register(aten.add.Tensor, ...)`` makes ``fn`` the rule of those overloads."""

    def deco(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return deco


def unsupported(op: Any, specs: list[DTensorSpec | None], why: str = "has no sharding rule") -> NotImplementedError:
    placements = [display(s.placements, s.shard_order) for s in specs if s is not None]
    return NotImplementedError(f"shardtensor: {op} {why} (input placements: {', '.join(placements)})")


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


def clear_cache(maxsize: int | None = None) -> None:
    global _cache
    _cache = _LRU(maxsize or _cache.maxsize)


def cache_info() -> dict[str, int]:
    return {"hits": _cache.hits, "misses": _cache.misses, "size": len(_cache.data), "maxsize": _cache.maxsize}


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


def _meta(spec: DTensorSpec) -> torch.Tensor:
    return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")


_META = torch.device("meta")


def _to_meta(a: Any, s: DTensorSpec | None) -> Any:
    if s is not None:
        return _meta(s)
    if isinstance(a, torch.Tensor):
        return a.to("meta")
    if isinstance(a, torch.device):
        return _META
    return a


def _out_meta(op, flat, specs, treedef) -> Any:
    """Output shape/stride/dtype from running the op on meta tensors of the global shapes."""
    args, kwargs = tree_unflatten([_to_meta(a, s) for a, s in zip(flat, specs)], treedef)
    return op(*args, **kwargs)


def _find_rule(op) -> Rule | None:
    if op._overloadname.startswith("out"):
        return None
    rule = RULES.get(op)
    if rule is None:
        tags = op.tags
        for tag, fn in TAG_RULES:
            if tag in tags:
                return fn
    return rule


def propagate(op, flat: list[Any], specs: list[DTensorSpec | None], treedef) -> Decision:
    """The decision for one call, from the cache when the same signature was seen before."""
    key = (op, treedef, tuple(s if s is not None else _freeze(a) for a, s in zip(flat, specs)))
    d = _cache.get(key)
    if d is not None:
        return d
    meshes = {s.mesh for s in specs if s is not None}
    if len(meshes) > 1:
        raise ValueError(f"{op}: operands live on different meshes {sorted(map(repr, meshes))}")
    rule = _find_rule(op)
    if rule is None:
        raise unsupported(op, specs)
    d = rule(Call(op, flat, specs, treedef, _out_meta(op, flat, specs, treedef)))
    _cache.put(key, d)
    return d


from .rules import factory, pointwise, reduction, view  # noqa: E402,F401  (registers the rules)
