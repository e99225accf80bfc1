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

from ..errors import MeshMismatchError, PropagationError, ShardingError, UnsupportedOpError
from ..placement import display
from ..spec import DTensorSpec

__all__ = ["Call", "Decision", "register", "propagate", "RULES", "TAG_RULES", "clear_cache", "cache_info",
           "unsupported", "MeshMismatchError", "Candidate", "decide"]


_UNSET = object()


class FlatCall(tuple):
    """Tree spec of a call nested at most one level: ``(arg shapes, kwarg names, kwarg shapes)``.

    An arg shape is ``None`` for a leaf or ``(type, n)`` for a list/tuple/Size of ``n`` leaves.
    The flat leaves are exactly pytree's, but building and hashing this costs a fraction of a
    pytree walk, which matters on every cached dispatch.
    """

    __slots__ = ()


_SEQ = (list, tuple)
_NODES = (list, tuple, dict)


def _shape_of(a: Any, flat: list) -> Any:
    if isinstance(a, _SEQ):
        for x in a:
            if isinstance(x, (list, tuple, dict)):
                raise _Nested
        flat.extend(a)
        return (type(a), len(a))
    if isinstance(a, dict):
        raise _Nested
    flat.append(a)
    return None


class _Nested(Exception):
    pass


_PLAIN: dict[int, FlatCall] = {}


def flatten_call(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """``(flat leaves, treedef)`` like ``tree_flatten((args, kwargs))``, fast for shallow calls."""
    if not kwargs:
        for a in args:
            if isinstance(a, _NODES):
                break
        else:
            n = len(args)
            tdef = _PLAIN.get(n)
            if tdef is None:
                tdef = _PLAIN[n] = FlatCall(((None,) * n, (), ()))
            return list(args), tdef
    flat: list = []
    try:
        shapes = tuple(_shape_of(a, flat) for a in args)
        if kwargs:
            kw = tuple(_shape_of(a, flat) for a in kwargs.values())
            return flat, FlatCall((shapes, tuple(kwargs), kw))
        return flat, FlatCall((shapes, (), ()))
    except _Nested:
        return tree_flatten((args, kwargs))


def _rebuild(shapes, flat: list, i: int, out: list) -> int:
    for sh in shapes:
        if sh is None:
            out.append(flat[i])
            i += 1
        else:
            typ, n = sh
            out.append(typ(flat[i:i + n]))
            i += n
    return i


def unflatten_call(flat: list, treedef: Any) -> tuple[tuple, dict]:
    if isinstance(treedef, FlatCall):
        shapes, names, kw = treedef
        args: list = []
        i = _rebuild(shapes, flat, 0, args)
        if not names:
            return tuple(args), {}
        vals: list = []
        _rebuild(kw, flat, i, vals)
        return tuple(args), dict(zip(names, vals))
    return tree_unflatten(flat, treedef)


@dataclass(frozen=True)
class Decision:
    """What a rule decided: required spec per flat argument (None = leave it) and output spec(s).

    Decisions are cached and shared by every rank, so nothing in one may depend on the rank;
    rank-dependent work happens in ``local_args`` and ``kernel``, which run per call.
    """

    inputs: tuple[DTensorSpec | None, ...]
    output: Any
    redistribute: bool
    local_args: Callable[[list[Any]], list[Any]] | None = None
    """Per-rank rewrite of the flat local arguments (e.g. global sizes -> this rank's local sizes)."""
    kernel: Callable[..., Any] | None = None
    """Custom local step ``kernel(*local_args, **local_kwargs)`` run instead of the op (it may use
    small collectives, e.g. a scalar all-reduce); ``None`` runs the aten op itself."""
    copies: bool = False
    """The kernel returns new memory built from other ranks' data: for a view op, the result does
    not alias its base (redistributed inputs count as such without this flag)."""


class Call:
    """One op call as the rules see it: flat args, their specs (None for non-DTensors), output meta.

    ``out_meta`` (global output shape/stride/dtype on meta tensors) is computed on first use
    only, so rules that do not need it never pay for it.
    """

    __slots__ = ("op", "flat", "specs", "treedef", "_meta")

    def __init__(self, op, flat: list[Any], specs: list[DTensorSpec | None], treedef, out_meta: Any = _UNSET) -> None:
        self.op, self.flat, self.specs, self.treedef, self._meta = op, flat, specs, treedef, out_meta

    @property
    def out_meta(self) -> Any:
        if self._meta is _UNSET:
            self._meta = _out_meta(self.op, self.flat, self.specs, self.treedef)
        return self._meta

    @property
    def tensor_positions(self) -> list[int]:
        return [i for i, s in enumerate(self.specs) if s is not None]

    @property
    def mesh(self):
        return self.specs[self.tensor_positions[0]].mesh

    def args_kwargs(self) -> tuple[tuple, dict]:
        return unflatten_call(self.flat, self.treedef)

    def spec_args(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with every DTensor replaced by its spec."""
        return unflatten_call([a if s is None else s for a, s in zip(self.flat, self.specs)], self.treedef)

    def arg(self, name: str, default: Any = None) -> Any:
        """Argument ``name`` of the op's schema (positional or keyword; DTensors as specs)."""
        args, kwargs = self.spec_args()
        if name in kwargs:
            return kwargs[name]
        for i, a in enumerate(self.op._schema.arguments):
            if a.name == name:
                if i < len(args):
                    return args[i]
                return default
        raise KeyError(f"{self.op} has no argument {name!r}")

    def slots(self, name: str) -> Any:
        """Flat position(s) of argument ``name``: an int, a list of ints for a list arg, or None."""
        args, kwargs = unflatten_call(list(range(len(self.flat))), self.treedef)
        if name in kwargs:
            return kwargs[name]
        for i, a in enumerate(self.op._schema.arguments):
            if a.name == name:
                return args[i] if i < len(args) else None
        return None

    def pos(self, name: str) -> int | None:
        """Flat position of the top-level tensor argument ``name`` (None when absent or not a DTensor)."""
        where = self.slots(name)
        if isinstance(where, int) and self.specs[where] is not None:
            return where
        return None

    def positions(self, name: str) -> list[int | None]:
        """Flat positions of the elements of the tensor-list argument ``name`` (None for non-DTensors)."""
        where = self.slots(name)
        if not isinstance(where, (list, tuple)):
            return []
        return [w if isinstance(w, int) and self.specs[w] is not None else None for w in where]


Rule = Callable[[Call], "Decision | list"]
RULES: dict[Any, Rule] = {}
TAG_RULES: list[tuple[torch.Tag, Rule]] = []
SCALARS_BY_SIGN: set[Any] = set()
_BY_SIGN: set[int] = set()  # ids of SCALARS_BY_SIGN (OpOverload hashes in Python; ids are cheap)
"""Ops whose decision depends on a Python scalar only through its type and sign: their cache
key holds ``(type, sign)`` so ``x * 2.0`` and ``x * 3.0`` share an entry."""


def register(*ops: Any, scalars_by_sign: bool = False) -> Callable[[Rule], Rule]:
    """Decorator: ``@register(aten.add.Tensor, ...)`` makes ``fn`` the rule of those overloads.

    A rule returns a :class:`Decision` or a list of :class:`Candidate` (selected by cost).
    ``scalars_by_sign=True`` declares that only the type and sign of scalar arguments matter.
    """

    def deco(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
            if scalars_by_sign:
                SCALARS_BY_SIGN.add(op)
                _BY_SIGN.add(id(op))
            _route.pop(id(op), None)
        return fn

    return deco


def unsupported(op: Any, specs: list[DTensorSpec | None], why: str = "has no sharding rule") -> UnsupportedOpError:
    placements = [display(s.placements, s.shard_order) for s in specs if s is not None]
    return UnsupportedOpError(f"shardtensor: {op} {why} (input placements: {', '.join(placements)})", op)


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
    args, kwargs = unflatten_call([_to_meta(a, s) for a, s in zip(flat, specs)], treedef)
    return op(*args, **kwargs)


def _is_out_overload(op) -> bool:
    return any(a.is_out for a in op._schema.arguments) if hasattr(op._schema.arguments[0], "is_out") else \
        op._overloadname.startswith("out")


def _find_rule(op) -> Rule | None:
    rule = RULES.get(op)
    if rule is None and not _is_out_overload(op):
        tags = op.tags
        for tag, fn in TAG_RULES:
            if tag in tags:
                if tag is torch.Tag.pointwise:
                    SCALARS_BY_SIGN.add(op)
                    _BY_SIGN.add(id(op))
                return fn
    return rule


_route: dict[int, Any] = {}
"""id(op) -> its rule, or ``("decompose", fn)``, or None: resolved once per op (ops live forever)."""


def route(op) -> Any:
    """How ``op`` is handled: a rule (callable), ``("decompose", fn)``, or ``None`` (unsupported)."""
    r = _route.get(id(op), _MISSING)
    if r is _MISSING:
        r = _find_rule(op)
        if r is None:
            from .decompose import find_decomposition

            fn = find_decomposition(op)
            r = ("decompose", fn) if fn is not None else None
        _route[id(op)] = r
    return r


_MISSING = object()


def propagate(op, flat: list[Any], specs: list[DTensorSpec | None], treedef) -> Decision:
    """The decision for one call, from the cache when the same signature was seen before."""
    fr = _sign if id(op) in _BY_SIGN else _freeze
    key = (id(op), treedef, tuple(s if s is not None else fr(a) for a, s in zip(flat, specs)))
    d = _cache.get(key)
    if d is not None:
        return d
    mesh = None
    for s in specs:
        if s is not None:
            if mesh is None:
                mesh = s.mesh
            elif s.mesh != mesh:
                raise MeshMismatchError(f"{op}: cross-mesh operation, operands live on different meshes "
                                        f"{mesh!r} and {s.mesh!r}")
    rule = route(op)
    if rule is None or isinstance(rule, tuple):
        raise unsupported(op, specs)
    call = Call(op, flat, specs, treedef)
    try:
        d = rule(call)
    except (ShardingError, NotImplementedError):
        raise
    except RuntimeError as e:  # torch's own checks, met while the rule evaluated metadata
        raise PropagationError(f"shardtensor: sharding propagation failed on {op} "
                               f"(input placements: {_placements(specs)}): {e}") from e
    if isinstance(d, list):
        d = decide(call, d)
    elif isinstance(d, Candidate):
        d = decide(call, d)
    if not isinstance(d, Decision):
        raise ValueError(f"shardtensor: rule of {op} returned {type(d).__name__}, expected a Decision or candidates")
    _cache.put(key, d)
    return d


def _placements(specs) -> str:
    return ", ".join(display(s.placements, s.shard_order) for s in specs if s is not None)


from .strategy import Candidate, decide  # noqa: E402
from .rules import (attention, embedding, factory, foreach, histogram, indexing, matrix, misc, nn, norm,  # noqa: E402,F401
                    pointwise, reduction, shaping, view)  # (importing registers the rules)
