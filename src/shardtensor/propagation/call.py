"""One op call as the rules see it: flattened arguments, their specs, output metadata, and the
:class:`Decision` a rule returns for it.

Arguments are flattened once per dispatch (:func:`flatten_call`, a fast path for calls nested at
most one level), DTensors are seen as their specs, and the global output metadata is computed
on meta tensors only when a rule asks for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import UnsupportedOpError
from ..spec import DTensorSpec, contiguous_stride, placements_text

__all__ = ["Call", "Decision", "FlatCall", "flatten_call", "unflatten_call"]


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

    __slots__ = ("op", "flat", "specs", "treedef", "_meta", "_args", "_slots")

    def __init__(self, op, flat: list[Any], specs: list[DTensorSpec | None], treedef, out_meta: Any = _UNSET) -> None:
        self.op, self.flat, self.specs, self.treedef, self._meta = op, flat, specs, treedef, out_meta
        self._args: tuple | None = None  # (the specs list it was built from, spec_args())
        self._slots: tuple[tuple, dict] | None = None  # the call's structure over flat positions

    @property
    def out_meta(self) -> Any:
        if self._meta is _UNSET:
            self._meta = _out_meta(self.op, self.flat, self.specs, self.treedef)
        return self._meta

    def shaped_meta(self, shape: Sequence[int]) -> Any:
        """``out_meta`` of an op with one output whose global ``shape`` the rule knows (a
        reduction's, softmax's): see ``_shaped_meta``."""
        if self._meta is _UNSET:
            self._meta = _shaped_meta(self.op, self.flat, self.specs, self.treedef, tuple(shape))
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
        """``(args, kwargs)`` with every DTensor replaced by its spec (built once per ``specs``
        list: rules read several arguments; read-only)."""
        got = self._args
        if got is None or got[0] is not self.specs:
            got = self._args = (self.specs, unflatten_call([a if s is None else s for a, s in zip(self.flat, self.specs)],
                                                           self.treedef))
        return got[1]

    def arg(self, name: str, default: Any = None) -> Any:
        """Argument ``name`` of the op's schema (positional or keyword; DTensors as specs)."""
        args, kwargs = self.spec_args()
        if name in kwargs:
            return kwargs[name]
        i = _arg_index(self.op).get(name)
        if i is None:
            raise KeyError(f"{self.op} has no argument {name!r}")
        return args[i] if i < len(args) else default

    def slots(self, name: str) -> Any:
        """Flat position(s) of argument ``name``: an int, a list of ints for a list arg, or None."""
        if self._slots is None:
            self._slots = unflatten_call(list(range(len(self.flat))), self.treedef)
        args, kwargs = self._slots
        if name in kwargs:
            return kwargs[name]
        i = _arg_index(self.op).get(name)
        return args[i] if i is not None and i < len(args) else None

    def refuse(self, why: str) -> UnsupportedOpError:
        """The one error of a rule that cannot decide this call: ``raise call.refuse("with ...")``."""
        return unsupported(self.op, self.specs, why)

    def need(self, names: Sequence[str]) -> None:
        """Refuse the call unless every tensor argument in ``names`` is a DTensor (the ``needs`` a
        rule declares with ``register``; the engine checks them before the rule runs)."""
        for name in names:
            if self.pos(name) is None:
                raise self.refuse(f"with a plain tensor (or none) as {name!r}")

    def spec(self, name: str) -> DTensorSpec:
        """The spec of tensor argument ``name``, a DTensor the rule needs (see ``need``)."""
        pos = self.pos(name)
        if pos is None:
            raise self.refuse(f"with a plain tensor (or none) as {name!r}")
        return self.specs[pos]  # type: ignore[return-value]

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


_ARG_INDEX: dict[int, dict[str, int]] = {}


def _arg_index(op: Any) -> dict[str, int]:
    """Schema argument name -> position, once per op."""
    got = _ARG_INDEX.get(id(op))
    if got is None:
        got = _ARG_INDEX[id(op)] = {a.name: i for i, a in enumerate(op._schema.arguments)}
    return got


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
    """Output shape/stride/dtype from running the op on meta tensors of the global shapes (or,
    for a pointwise op on inputs of one contiguous shape, ``_pointwise_meta``)."""
    out = _pointwise_meta(op, flat, specs, treedef)
    if out is not None:
        return out
    args, kwargs = unflatten_call([_to_meta(a, s) for a, s in zip(flat, specs)], treedef)
    return op(*args, **kwargs)


def _shaped_meta(op, flat, specs, treedef, shape: tuple) -> Any:
    """``shape``, contiguous, with the dtype the op gives on tensors of ones of the inputs' ranks
    and dtypes (a reduction keeps its dims and arguments: ``sum(x, 1, dtype=...)`` runs as such on
    a ``(1, 1)`` tensor).  Torch's meta kernels of reductions are Python references (~30 us).
    The meta kernels decide instead where an input is not contiguous, a plain tensor takes part,
    or the small run fails or gives another rank or type (``mean`` of ints: torch's error then)."""
    for a, s in zip(flat, specs):
        if (isinstance(a, torch.Tensor) if s is None else tuple(s.stride) != contiguous_stride(s.shape)):
            return _out_meta(op, flat, specs, treedef)
    out = _small_run(op, flat, specs, treedef,
                     lambda: [a if s is None else torch.ones((1,) * len(s.shape), dtype=s.dtype)
                              for a, s in zip(flat, specs)])
    if out is None or out[1] != len(shape):
        return _out_meta(op, flat, specs, treedef)
    return torch.empty_strided(shape, contiguous_stride(shape), dtype=out[0], device=_META)


_RUNS: dict[tuple, tuple[torch.dtype, int] | None] = {}


def _small_run(op, flat: list, specs: list, treedef, tiny: Callable[[], list]) -> tuple[torch.dtype, int] | None:
    """``(dtype, ndim)`` of ``op`` on the flat arguments ``tiny()`` (fresh small tensors built from
    the arguments' dtypes and ranks: nothing requires grad, an in-place op writes nothing of the
    caller's), or ``None`` where it raises (the meta kernels then raise torch's own error) or
    returns anything but one tensor.  Kept per op, call structure, dtypes, ranks and other
    arguments (it depends on nothing else), so a new shape runs nothing."""
    key: tuple | None
    try:
        key = (id(op), treedef, *map(_describe, flat, specs))
        if key in _RUNS:
            return _RUNS[key]
    except TypeError:  # an unhashable argument: run it
        key = None
    args, kwargs = unflatten_call(tiny(), treedef)
    got: tuple[torch.dtype, int] | None
    try:
        out = op(*args, **kwargs)
        got = (out.dtype, out.ndim) if type(out) is torch.Tensor else None
    except Exception:  # noqa: BLE001
        got = None
    if key is not None:
        if len(_RUNS) > 4096:
            _RUNS.clear()
        _RUNS[key] = got
    return got


def _describe(a: Any, s: DTensorSpec | None) -> tuple:
    """What a small run depends on in one argument: a tensor's dtype and rank, another's value."""
    if s is not None:
        return (s.dtype, len(s.shape))
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.ndim, a.device)
    return (type(a), a)


_POINTWISE: dict[int, bool] = {}
_LAYOUT_ARGS = frozenset({"memory_format", "layout", "device", "size", "stride"})
"""Arguments that can make an output other than contiguous (``clone(memory_format=...)``)."""


def _pointwise_meta(op, flat, specs, treedef) -> torch.Tensor | None:
    """The output of a pointwise op whose tensor inputs with dims all have one contiguous shape
    (the common case: ``a + b``, ``x * 2``): that shape, contiguous, with the dtype the op gives
    on one-element CPU tensors of the inputs' dtypes (type promotion, comparisons and ops such
    as ``sigmoid`` of an int all as torch's kernels decide).  Torch's meta kernels of pointwise
    ops are Python references, 0.1-1 ms a call; this is a few microseconds.  ``None`` where it
    does not apply (other shapes or layouts, a layout argument, random ops, several outputs, an
    error): the caller runs the meta kernels."""
    pw = _POINTWISE.get(id(op))
    if pw is None:
        sch = op._schema
        pw = _POINTWISE[id(op)] = (torch.Tag.pointwise in op.tags and torch.Tag.nondeterministic_seeded not in op.tags
                                   and len(sch.returns) == 1 and not any(a.is_out or a.name in _LAYOUT_ARGS
                                                                         for a in sch.arguments))
    if not pw:
        return None
    shape: tuple | None = None
    stride: tuple = ()
    for a, s in zip(flat, specs):
        if s is None:
            if isinstance(a, torch.Tensor) and a.ndim > 0:
                return None
            continue
        if not s.shape:
            continue
        if shape is None:
            shape = tuple(s.shape)
            stride = contiguous_stride(shape)
        if tuple(s.shape) != shape or tuple(s.stride) != stride:
            return None
    if shape is None:
        return None
    out = _small_run(op, flat, specs, treedef,
                     lambda: [(torch.ones((), dtype=a.dtype) if isinstance(a, torch.Tensor) else a) if s is None
                              else torch.ones((1,) if s.shape else (), dtype=s.dtype)  # a plain 0-d one too
                              for a, s in zip(flat, specs)])
    return None if out is None else torch.empty_strided(shape, stride, dtype=out[0], device=_META)


def unsupported(op: Any, specs: Sequence[DTensorSpec | None], why: str = "has no sharding rule") -> UnsupportedOpError:
    """The error of an op no rule decides for these placements (``Call.refuse`` inside a rule)."""
    return UnsupportedOpError(f"shardtensor: {op} {why} (input placements: {placements_text(list(specs))})", op)
