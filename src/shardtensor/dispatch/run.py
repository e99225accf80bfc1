"""Dispatch: every aten op on DTensors, top-down.

``dispatch`` routes the op (:func:`route`: its sharding rule, else a decomposition into ops that
have rules), asks propagation for the decision, redistributes the inputs it requires, runs the
local kernel and wraps the result.  An op with no rule for its inputs runs on replicated inputs
(``fallback.py``: visible, exact, off under ``strict_sharding``).  Plain tensors met on the way are replicated values where
``implicit_replication`` allows them, and an error naming the argument elsewhere.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .. import comm
from ..aliasing import check_placement_change, check_writes, forget_copies, note_copies, op_kind
from ..errors import MeshMismatchError, UnsupportedOpError
from ..implicit import implicit_allowed, implicit_replication, plain_tensor_error
from ..listops import is_list_op, run_per_mesh
from ..placement import Partial
from ..propagation import flatten_call, propagate, rule_for, unflatten_call
from ..propagation.engine import HOT, HOT_HITS, _freeze, _sign, remember
from ..propagation.registry import _BY_SIGN
from ..redistribute import redistribute_local
from ..spec import DTensorSpec, placements_text
from ..submesh import off_mesh_result
from ..tensor import DTensor
from .decompose import find_decomposition
from .fallback import (check_plain, fallback_allowed, replicate_plain, run_replicated, whole_local, wrap_replicated,
                       write_into)

__all__ = ["dispatch", "route"]

_decomposed: dict[int, Any] = {}
_MISSING = object()


def route(op) -> Any:
    """How ``op`` is handled: its rule (callable), ``("decompose", fn)``, or ``None`` (unsupported)."""
    rule = rule_for(op)
    if rule is not None:
        return rule
    fn = _decomposed.get(id(op), _MISSING)
    if fn is _MISSING:
        fn = _decomposed[id(op)] = find_decomposition(op)
    return ("decompose", fn) if fn is not None else None


def dispatch(func, args: tuple, kwargs: dict) -> Any:
    """propagation -> redistribute -> local kernel -> wrap (or a decomposition into ops that have rules)."""
    hot = _HOT_OPS.get(id(func))
    if hot is None:
        hot = _HOT_OPS[id(func)] = _hot_facts(func)
    if hot[0]:
        out = _hit(func, args, kwargs, hot[1], hot[2])
        if out is not _MISSING:
            return out
    view, writes = op_kind(func)
    if writes:
        check_writes(func, writes, args, kwargs)
    r = route(func)
    if isinstance(r, tuple):
        check_plain(func, tree_flatten((args, kwargs))[0])
        try:
            with implicit_replication():  # plain tensors the decomposition builds are the same on every rank
                out = replicate_plain(r[1](*args, **kwargs), args, kwargs)
            return out if view else forget_copies(out)  # a non-view op's results are its own memory
        except NotImplementedError as e:
            if isinstance(e, UnsupportedOpError) and e.op == func:
                raise
            if not writes and fallback_allowed(func):  # nothing was written: safe to run it whole
                return run_replicated(func, args, kwargs, False)
            pls = placements_text([a._spec for a in tree_flatten((args, kwargs))[0] if isinstance(a, DTensor)])
            raise UnsupportedOpError(f"shardtensor: {func} has no sharding rule and its decomposition failed "
                                      f"(input placements: {pls}): {e}", func) from e
    flat, treedef = flatten_call(args, kwargs)
    specs: list[DTensorSpec | None] = []
    plain: list[int] | None = None
    first: DTensor | None = None
    for i, a in enumerate(flat):
        if isinstance(a, DTensor):
            specs.append(a._spec)
            if first is None:
                first = a
        else:
            if isinstance(a, torch.Tensor) and a.ndim > 0:  # a plain tensor with dims (check_plain), inlined: the hot loop
                plain = (plain or []) + [i]
            specs.append(None)
    if plain is not None:
        return _dispatch_with_plain(func, flat, specs, treedef, plain)
    try:
        decision = propagate(func, flat, specs, treedef)
    except MeshMismatchError:
        if not is_list_op(func):
            raise
        return run_per_mesh(func, args, kwargs, dispatch, DTensor)
    except UnsupportedOpError as e:
        if e.op is not func or not fallback_allowed(func):
            raise
        return run_replicated(func, args, kwargs, _returns_self(func))
    # a rank outside the mesh holds an empty (or 0-d placeholder) local tensor and runs nothing; the
    # size test first keeps the rank lookup off the hot path
    if first is not None and first._local_tensor.numel() <= 1 and first._spec.mesh._coord is None:
        return off_mesh_result(func, decision.output, flat[0], first._local_tensor.device, first.dtype,
                               _returns_self(func), DTensor)
    if not decision.redistribute:
        local = [a if s is None else a._local_tensor for a, s in zip(flat, specs)]
    elif comm.listening():
        with comm.scope(str(func)):
            local = _local_args(flat, specs, decision)
    else:
        local = _local_args(flat, specs, decision)
    if decision.local_args is not None:
        local = decision.local_args(local)
    largs, lkwargs = unflatten_call(local, treedef)
    inplace = _returns_self(func)
    keep = inplace and first is flat[0] and _keeps_placements(first._spec, decision.output)
    if inplace and first is flat[0] and not keep:  # before the kernel writes: raising then loses nothing
        check_placement_change(func, first, decision.output, local[0] is not first._local_tensor)
    out = (decision.kernel or func)(*largs, **lkwargs)
    if inplace:
        me = flat[0]
        if keep:
            write_into(me, local[0], decision.output)
        elif isinstance(me, DTensor):
            if local[0] is not me._local_tensor:
                me._local_tensor = local[0]
            if isinstance(decision.output, DTensorSpec) and decision.output != me._spec:
                me._spec = decision.output
        return me
    out = _wrap(out, decision.output)
    if view:
        w = decision.inputs[0]
        note_copies(func, flat[0], decision.copies or (decision.redistribute and w is not None and w != specs[0]), out)
    return out


_HOT_OPS: dict[int, tuple[bool, bool, Any]] = {}
_LEAVES = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.memory_format,
                     torch.layout})


def _hot_facts(func) -> tuple[bool, bool, Any]:
    """``(may take the hit path, is a view op, how its scalars are keyed)``, once per op: ops with a
    rule that write into no argument."""
    view, writes = op_kind(func)
    ok = not writes and callable(route(func))  # route first: it marks the ops keyed by scalar sign
    return ok, view, _sign if id(func) in _BY_SIGN else _freeze


def _hit(func, args: tuple, kwargs: dict, view: bool, freeze: Any) -> Any:
    """The op run on a cached decision that moves nothing: unwrap, run, wrap; ``_MISSING`` sends
    the call down the full path (plain tensors, redistribution, off-mesh ranks, errors).

    The key holds each DTensor's spec by id (the entry holds the specs, so no id is reused while it
    lives) and other arguments frozen as ``propagate`` freezes them; a call of flat positional
    arguments (the common case) is keyed and run without building its tree."""
    treedef = None
    flat: Any = args
    if kwargs or any(type(a) is list or type(a) is tuple for a in args):
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
        elif type(a) in _LEAVES:
            key.append(freeze(a))
            local.append(a)
        else:
            return _MISSING
    if first is None:
        return _MISSING
    k = tuple(key)
    entry = HOT.get(k)
    if entry is None:
        decision = _hot_decision(func, args, kwargs, k)
        if decision is None:
            return _MISSING
    else:
        decision = entry[0]
        HOT_HITS.n += 1
    if first._local_tensor.numel() <= 1 and first._spec.mesh._coord is None:
        return _MISSING  # a rank outside the mesh runs nothing
    if decision.local_args is not None:
        local = decision.local_args(local)
    if treedef is None:
        out = (decision.kernel or func)(*local)
    else:
        largs, lkwargs = unflatten_call(local, treedef)
        out = (decision.kernel or func)(*largs, **lkwargs)
    spec = decision.output
    out = DTensor(out, spec) if type(spec) is DTensorSpec and out.dtype is spec.dtype else _wrap(out, spec)
    if view:
        note_copies(func, flat[0], decision.copies, out)
    return out


def _hot_decision(func, args: tuple, kwargs: dict, key: tuple) -> Any:
    """The decision for a call the hit path has not seen, kept under ``key`` when it moves nothing;
    ``None`` when it does or propagation raises (the full path then raises it again, or handles it)."""
    flat, treedef = flatten_call(args, kwargs)
    specs = [a._spec if type(a) is DTensor else None for a in flat]
    try:
        decision = propagate(func, flat, specs, treedef)
    except Exception:  # noqa: BLE001
        return None
    if decision.redistribute:
        return None
    remember(key, decision, tuple(s for s in specs if s is not None))
    return decision


def _dispatch_with_plain(func, flat: list, specs: list, treedef, plain: list[int]) -> Any:
    """Dispatch with the plain tensors at ``plain`` taken as replicated values (see ``implicit``).

    An in-place op on a plain ``self`` leaves the whole result in that plain tensor and returns it.
    """
    mesh = next(s.mesh for s in specs if s is not None)
    flat = list(flat)
    plain_self = flat[0] if plain[0] == 0 and _returns_self(func) else None
    for i in plain:
        t = flat[i]
        if not implicit_allowed(t):
            raise plain_tensor_error(func, t)
        flat[i] = wrap_replicated(t, mesh)
    args, kwargs = unflatten_call(flat, treedef)
    out = dispatch(func, args, kwargs)
    if plain_self is not None:
        full = whole_local(out)
        if full is not plain_self:
            plain_self.copy_(full)
        return plain_self
    return out


_SELF_RETURN: dict[int, bool] = {}


def _returns_self(func) -> bool:
    """In-place ops that return their (DTensor) self argument."""
    r = _SELF_RETURN.get(id(func))
    if r is None:
        sch = func._schema
        rets = sch.returns
        r = bool(len(rets) == 1 and rets[0].alias_info is not None and rets[0].alias_info.is_write
                 and sch.arguments and sch.arguments[0].alias_info is not None
                 and sch.arguments[0].alias_info.is_write and not sch.arguments[0].kwarg_only)
        _SELF_RETURN[id(func)] = r
    return r


def _keeps_placements(spec: DTensorSpec, out: Any) -> bool:
    """Whether an in-place op on ``spec`` keeps its placements: always for a shard or replica whose
    shape the op keeps.  A Partial self may be reduced in place (it becomes the result's placements;
    ``check_placement_change`` refuses that while views share its memory); in-place view ops
    (``t_``, ``squeeze_``) take the result's spec."""
    return (isinstance(out, DTensorSpec) and out.shape == spec.shape
            and not any(isinstance(p, Partial) for p in spec.placements))


def _local_args(flat: list, specs: list, decision) -> list:
    """Local tensors of the arguments, redistributed where the decision requires."""
    local = []
    for a, s, want in zip(flat, specs, decision.inputs):
        if s is None:
            local.append(a)
        elif decision.redistribute and want is not None and want != s:
            local.append(redistribute_local(a._local_tensor, s, want))
        else:
            local.append(a._local_tensor)
    return local


def _wrap(out: Any, spec: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return DTensor(out, spec if out.dtype is spec.dtype else _retyped(spec, out.dtype))
    if isinstance(out, (tuple, list)):
        return type(out)(_wrap(o, s) for o, s in zip(out, spec))
    return out


_RETYPED: dict[tuple[DTensorSpec, torch.dtype], DTensorSpec] = {}


def _retyped(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    """``spec`` with the dtype the local kernel produced: a rule's metadata comes from meta kernels,
    which can differ from a device's (CPU layer norm keeps half statistics half), and a DTensor
    must report the dtype its data has."""
    key = (spec, dtype)
    r = _RETYPED.get(key)
    if r is None:
        if len(_RETYPED) > 1024:
            _RETYPED.clear()
        r = _RETYPED[key] = replace(spec, dtype=dtype)
    return r
