"""The hit path of dispatch: a call whose decision is cached and moves nothing runs as unwrap,
kernel, wrap.

The key holds each DTensor argument's spec by id (the cache entry holds the specs, so no id is
reused while it lives) and every other argument frozen as propagation freezes it; a call of flat
positional arguments (the common case) is keyed and run without building its argument tree.
Anything else -- plain tensors, a decision that redistributes or whose view results are copies, a
rank outside the mesh, a write into a copied view or one that would change placements, an error
-- returns ``MISSING`` and takes the full path (``run.py``), which does the same work in full.

In-place ops take this path too when they write only into their first argument (``x.add_(y)``,
``torch._foreach_mul_(xs, s)``) and keep its placements: the kernel writes into the local
tensors, as the full path would.  The last step, ``finish``, is shared with the full path: a
result reports the dtype its local data has (``retyped``), an in-place op returns its self.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch

from ..propagation import flatten_call, propagate, unflatten_call
from ..propagation.engine import HOT, HOT_HITS, remember
from ..spec import DTensorSpec
from ..tensor import DTensor
from .bindings import local_kernel
from .fallback import write_into

__all__ = ["MISSING", "hit", "finish", "wrap", "keeps_placements"]

MISSING = object()
LEAVES = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.memory_format,
                    torch.layout})
"""Argument types the hit path keys by value; any other (a plain tensor, a list of lists) takes the full path."""

NO_WRITES, WRITES_SELF, WRITES_LIST = 0, 1, 2
"""What an op writes, for the hit path: nothing; its first argument, which it returns (``add_``);
its first argument, a list (``_foreach_mul_``)."""


def hit(func: Any, args: tuple, kwargs: dict, writes: int, written: tuple, freeze: Any) -> Any:
    """``func`` on a cached decision that moves nothing, or ``MISSING`` (``writes``: the kind of
    in-place op, ``written``: the positions of the arguments it writes)."""
    names = tuple(kwargs) if kwargs else ()  # keyword arguments are keyed after the positional ones, by name
    key: list = [id(func), _KWARGS, names] if kwargs else [id(func)]
    items = (*args, *kwargs.values()) if kwargs else args
    local: list = []
    first = None
    for a in items:
        t = type(a)
        if t is DTensor:
            key.append(id(a._spec))
            local.append(a._local_tensor)
            if first is None:
                first = a
        elif t in LEAVES or (t is torch.Tensor and a.ndim == 0):  # 0-d: a fused step's counters
            key.append(freeze(a))
            local.append(a)
        elif t is list or t is tuple:
            f = _sequence(a, t, key, local, freeze)
            if f is MISSING or f is _FLAT:
                return _run_flat(func, args, kwargs, writes, written, freeze) if f is _FLAT else MISSING
            if first is None:
                first = f
        else:
            return MISSING
    largs, lkwargs = (local[:len(args)], dict(zip(names, local[len(args):]))) if kwargs else (local, None)
    entry = _decision(func, args, kwargs, tuple(key), writes, written, first, largs, lkwargs)
    if entry is None or first is None:
        return MISSING
    decision, _, kernel = entry
    if decision.local_args is not None:  # it rewrites the flat arguments: run in flat form
        flat, treedef = flatten_call(args, kwargs)
        return _run_decided(func, decision, flat, treedef, [a._local_tensor if type(a) is DTensor else a for a in flat],
                            first, writes)
    out = kernel(*largs, **lkwargs) if lkwargs is not None else kernel(*largs)
    if writes == WRITES_LIST:  # the op returns nothing (a binding of ``_foreach_add_`` returns its list)
        return None
    return finish(out, decision.output, first if writes else None, local[0], True)


def _sequence(a: Any, t: type, key: list, local: list, freeze: Any) -> Any:
    """Key and unwrap a list or tuple argument of ``hit``: the first DTensor in it (or ``None``),
    ``MISSING`` where the hit path does not take it, ``_FLAT`` where it runs in flat form."""
    if a and type(a[0]) is DTensor:  # a tensor list (foreach ops)
        try:
            key.append((t, len(a)))
            key.extend(map(id, map(_SPEC, a)))
            local.append(t(map(_LOCAL, a)))
        except AttributeError:  # a plain tensor or a number among DTensors
            return MISSING
        return a[0]
    if a and type(a[0]) is torch.Tensor:  # 0-d counters (fused steps)
        a0 = a[0]
        dtype, device = a0.dtype, a0.device
        if not all(type(x) is torch.Tensor and x.ndim == 0 and x.dtype is dtype and x.device == device for x in a):
            return MISSING
        key.append((t, len(a), dtype, device))
    else:  # sizes and dims keyed by value, scalar lists as scalars
        for v in a:
            if type(v) is not int:
                if not all(type(v) in _SCALARS for v in a):  # anything else runs in flat form
                    return _FLAT
                key.append((t, *map(freeze, a)))
                break
        else:
            key.append((t, *a))
    local.append(a)
    return None


_SCALARS = frozenset({int, float, bool})
_KWARGS, _FLAT = object(), object()
"""Marks where a key's keyword arguments begin (their names follow); a call to run in flat form."""
_SPEC, _LOCAL, _COPIED = attrgetter("_spec"), attrgetter("_local_tensor"), attrgetter("_copied_view")


def _run_flat(func: Any, args: tuple, kwargs: dict, writes: int, written: tuple, freeze: Any) -> Any:
    """The hit path for calls with keyword arguments or lists of sizes: keyed on the flat leaves."""
    flat, treedef = flatten_call(args, kwargs)
    key: list = [id(func), treedef]
    local: list = []
    first = None
    for a in flat:
        if type(a) is DTensor:
            key.append(id(a._spec))
            local.append(a._local_tensor)
            if first is None:
                first = a
        elif type(a) in LEAVES or (type(a) is torch.Tensor and a.ndim == 0):  # 0-d: a fused step's counters
            key.append(freeze(a))
            local.append(a)
        else:
            return MISSING
    entry = _decision(func, args, kwargs, tuple(key), writes, written, first, None, None)
    if entry is None or first is None:
        return MISSING
    return _run_decided(func, entry[0], flat, treedef, local, first, writes)


def _run_decided(func: Any, decision: Any, flat: list, treedef: Any, local: list, first: DTensor, writes: int) -> Any:
    """The kernel on the flat local arguments (rewritten by the decision's ``local_args``), finished."""
    if decision.local_args is not None:
        local = decision.local_args(local)
    largs, lkwargs = unflatten_call(local, treedef)
    out = (decision.kernel or func)(*largs, **lkwargs)
    if writes == WRITES_LIST:
        return None
    return finish(out, decision.output, first if writes else None, local[0], True)


def _decision(func: Any, args: tuple, kwargs: dict, key: tuple, writes: int, written: tuple,
              first: DTensor | None, largs: list | None, lkwargs: dict | None) -> tuple | None:
    """The cache entry ``(decision, specs, kernel)`` under ``key`` (made on first sight, the kernel
    chosen on the local arguments ``largs``, ``lkwargs`` where given), or ``None`` for a call the
    hit path does not take: no DTensor, a write it may not make, a rank outside the mesh."""
    if first is None or (writes and not _writable(args, writes, written, first)):
        return None
    if first._local_tensor.numel() <= 1 and first._spec.mesh._coord is None:
        return None  # a rank outside the mesh runs nothing (the full path knows what to return)
    entry = HOT.get(key)
    if entry is None:
        return _decide(func, args, kwargs, key, writes, largs, lkwargs)
    HOT_HITS.n += 1
    return entry


def finish(out: Any, spec: Any, me: DTensor | None, local0: Any, keep: bool) -> Any:
    """The kernel's result as dispatch returns it, on the hit path and the full path alike: for an
    in-place op, its DTensor self ``me`` (the kernel wrote ``local0``), which either keeps its
    placements and memory (``keep``: the result is written into them) or takes ``local0`` and the
    decided ``spec``; else the results wrapped as DTensors of ``spec``."""
    if me is None:
        return DTensor(out, spec) if type(spec) is DTensorSpec and out.dtype is spec.dtype else wrap(out, spec)
    if keep:
        if local0 is not me._local_tensor or spec is not me._spec:
            write_into(me, local0, spec)
        return me
    if local0 is not me._local_tensor:
        me._local_tensor = local0
    if isinstance(spec, DTensorSpec) and spec != me._spec:
        me._spec = spec
    return me


def _writable(args: tuple, writes: int, written: tuple, first: DTensor) -> bool:
    """Whether the written arguments are DTensor memory the hit path may write: passed by
    position, not copied views (the full path raises there), and for ``WRITES_SELF`` the first
    DTensor argument itself."""
    if writes == WRITES_SELF:
        return bool(args) and args[0] is first and first._copied_view is None
    for i in written:
        a = args[i] if i < len(args) else None
        if (type(a) is not list and type(a) is not tuple) or (a and type(a[0]) is not DTensor):
            return False
        try:
            if any(map(_COPIED, a)):
                return False
        except AttributeError:  # a plain tensor or a number among DTensors
            return False
    return True


def _decide(func: Any, args: tuple, kwargs: dict, key: tuple, writes: int, largs: list | None,
            lkwargs: dict | None) -> tuple | None:
    """The cache entry for a call the hit path has not seen, kept under ``key`` when its decision
    moves nothing (and, for ``WRITES_SELF``, keeps self's placements); ``None`` otherwise or when
    propagation raises (the full path then raises it again, or handles it).  Its kernel is the
    decision's, else torch's binding of ``func`` where that calls ``func`` on ``largs``
    (``bindings.py``), else ``func``."""
    flat, treedef = flatten_call(args, kwargs)
    specs = [a._spec if type(a) is DTensor else None for a in flat]
    if any(s is not None and s.opaque for s in specs):
        return None  # the full path's (``opaque.py``)
    try:
        decision = propagate(func, flat, specs, treedef)
    except Exception:  # noqa: BLE001
        return None
    if decision.redistribute or decision.copies or (writes == WRITES_SELF and
                                                    not keeps_placements(args[0]._spec, decision.output)):
        return None  # (``_writable`` made sure a WRITES_SELF call's first argument is its DTensor self;
        # a view's results are views of its argument on this path, never copies: ``run.py`` records them so)
    kernel = decision.kernel or func
    if kernel is func and largs is not None and decision.local_args is None:
        # the choice depends on the arguments' types and structure, not on the specs: kept per
        # key with the spec ids (the only ints after the op's id) blanked, across cache clears
        sig = (key[0], *[None if type(k) is int else k for k in key[1:]])
        kernel = _KERNELS.get(sig)
        if kernel is None:
            if len(_KERNELS) > 4096:
                _KERNELS.clear()
            kernel = _KERNELS[sig] = local_kernel(func, largs, lkwargs or {})
    return remember(key, decision, tuple(s for s in specs if s is not None), kernel)


_KERNELS: dict[tuple, Any] = {}


def keeps_placements(spec: DTensorSpec, out: Any) -> bool:
    """Whether an in-place op on ``spec`` keeps its placements: always for a shard or replica whose
    shape the op keeps.  A Partial self may be reduced in place (it becomes the result's placements;
    ``check_placement_change`` refuses that while views share its memory); in-place view ops
    (``t_``, ``squeeze_``) take the result's spec."""
    return (isinstance(out, DTensorSpec) and out.shape == spec.shape
            and not any(p.is_partial() for p in spec.placements))


def wrap(out: Any, spec: Any) -> Any:
    """Local results as DTensors of the decided specs (tuples and lists alike)."""
    if isinstance(out, torch.Tensor):
        return DTensor(out, spec if out.dtype is spec.dtype else retyped(spec, out.dtype))
    if isinstance(out, (tuple, list)):
        return type(out)(wrap(o, s) for o, s in zip(out, spec))
    return out


_RETYPED: dict[tuple[DTensorSpec, torch.dtype], DTensorSpec] = {}


def retyped(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    """``spec`` with the dtype the local kernel produced: a rule's metadata comes from meta kernels,
    which can differ from a device's (CPU layer norm keeps half statistics half), and a DTensor
    must report the dtype its data has."""
    key = (spec, dtype)
    r = _RETYPED.get(key)
    if r is None:
        if len(_RETYPED) > 1024:
            _RETYPED.clear()
        r = _RETYPED[key] = spec.with_dtype(dtype)
    return r
