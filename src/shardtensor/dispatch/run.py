"""Dispatch: every aten op on DTensors, top-down.

``dispatch`` routes the op (:func:`route`: its sharding rule, else a decomposition into ops that
have rules), asks propagation for the decision, redistributes the inputs it requires, runs the
local kernel and wraps the result.  An op whose rule declines its inputs' placements takes our own
decomposition when it has one (``_fused_sgd_`` with misplaced momentum buffers); an op with no
rule for its inputs runs on replicated inputs
(``fallback.py``: visible, exact, off under ``strict_sharding``).  Plain tensors met on the way are replicated values where
``implicit_replication`` allows them, and an error naming the argument elsewhere.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .. import comm
from ..aliasing import check_placement_change, check_writes, forget_copies, note_copies, note_writes, op_kind
from ..errors import MeshMismatchError, UnsupportedOpError
from ..implicit import built_by_torch, implicit_allowed, implicit_replication, plain_tensor_error
from ..listops import is_list_op, run_per_mesh
from ..propagation import flatten_call, propagate, rule_for, unflatten_call
from ..propagation.engine import freezer
from ..redistribute import redistribute_local
from ..rng import agreed
from ..placement import Partial, Shard
from ..spec import DTensorSpec, placements_text
from ..submesh import off_mesh_result
from ..tensor import DTensor
from .decompose import DECOMPOSITIONS, find_decomposition
from .fallback import (check_plain, fallback_allowed, replicate_plain, run_replicated, whole_local, wrap_replicated,
                       write_into)
from .strided import dispatch_packed
from .hit import MISSING, NO_WRITES, WRITES_LIST, WRITES_SELF, hit, keeps_placements, wrap

__all__ = ["dispatch", "route"]

_decomposed: dict[int, Any] = {}


def route(op) -> Any:
    """How ``op`` is handled: its rule (callable), ``("decompose", fn)``, or ``None`` (unsupported)."""
    rule = rule_for(op)
    if rule is not None:
        return rule
    fn = _decomposed.get(id(op), MISSING)
    if fn is MISSING:
        fn = _decomposed[id(op)] = find_decomposition(op)
    return ("decompose", fn) if fn is not None else None


def _decompose(func, fn, args: tuple, kwargs: dict, view: bool, writes: tuple) -> Any:
    """``func`` computed by its decomposition ``fn``; where that fails before writing anything, on
    replicated inputs (``fallback.py``), else an error naming the op and the placements."""
    check_plain(func, tree_flatten((args, kwargs))[0])
    try:
        with implicit_replication():  # plain tensors the decomposition builds are the same on every rank
            out = replicate_plain(fn(*args, **kwargs), args, kwargs)
        return out if view else forget_copies(out)  # a non-view op's results are its own memory
    except NotImplementedError as e:
        if isinstance(e, UnsupportedOpError) and e.op == func:
            raise
        if not writes and fallback_allowed(func):  # nothing was written: safe to run it whole
            return run_replicated(func, args, kwargs, False)
        pls = placements_text([a._spec for a in tree_flatten((args, kwargs))[0] if isinstance(a, DTensor)])
        raise UnsupportedOpError(f"shardtensor: {func} has no sharding rule for these placements and its "
                                 f"decomposition failed (input placements: {pls}): {e}", func) from e


def dispatch(func, args: tuple, kwargs: dict) -> Any:
    """propagation -> redistribute -> local kernel -> wrap (or a decomposition into ops that have rules)."""
    if func is _DETACH and type(args[0]) is DTensor:  # autograd detaches every gradient it accumulates
        return _detach(args[0])
    facts = _HIT_FACTS.get(id(func))
    if facts is None:
        facts = _HIT_FACTS[id(func)] = _hit_facts(func)
    if facts[0]:
        out = hit(func, args, kwargs, *facts[1:])
        if out is not MISSING:
            if facts[2]:
                note_writes(func, args, kwargs)
            return out
    view, writes = op_kind(func)
    if not writes:
        return _dispatch(func, args, kwargs, view, writes)
    check_writes(func, writes, args, kwargs)
    out = _dispatch(func, args, kwargs, view, writes)
    note_writes(func, args, kwargs)  # the kernel wrote below autograd: tell it (``aliasing.py``)
    return out


def _dispatch(func, args: tuple, kwargs: dict, view: bool, writes: tuple) -> Any:
    """The full path: route, propagate, redistribute, run, wrap."""
    flat, treedef = flatten_call(args, kwargs)
    specs: list[DTensorSpec | None] = []
    plain: list[int] | None = None
    first: DTensor | None = None
    packed = False
    for i, a in enumerate(flat):
        if isinstance(a, DTensor):
            specs.append(a._spec)
            packed = packed or a._spec.strided
            if first is None:
                first = a
        else:
            if isinstance(a, torch.Tensor) and a.ndim > 0:  # a plain tensor with dims (check_plain), inlined: the hot loop
                plain = (plain or []) + [i]
            specs.append(None)
    if specs and specs[0] is None and type(flat[0]) is torch.Tensor and flat[0].ndim == 0 and _returns_self(func):
        plain = [0] + (plain or [])  # a plain 0-d self written in place (``total.add_(dt.sum())``) takes the value
    if packed:  # no rule reads a StridedShard (``strided.py``)
        return dispatch_packed(func, args, kwargs, flat, specs, treedef, view, _returns_self(func), dispatch)
    r = route(func)
    if isinstance(r, tuple):
        return _decompose(func, r[1], args, kwargs, view, writes)
    if plain is not None:
        return _dispatch_with_plain(func, flat, specs, treedef, plain)
    try:
        decision = propagate(func, flat, specs, treedef)
    except MeshMismatchError:
        if not is_list_op(func):
            raise
        return run_per_mesh(func, args, kwargs, dispatch, DTensor)
    except UnsupportedOpError as e:
        if e.op is not func:
            raise
        fn = DECOMPOSITIONS.get(func)  # a rule that declines these placements: our decomposition, if any
        if fn is not None:
            return _decompose(func, fn, args, kwargs, view, writes)
        if not fallback_allowed(func):
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
    keep = inplace and first is flat[0] and (keeps_placements(first._spec, decision.output)
                                             or _stays(first, decision.output))
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
    out = wrap(out, decision.output)
    if view:
        w = decision.inputs[0]
        note_copies(func, flat[0], decision.copies or (decision.redistribute and w is not None and w != specs[0]), out,
                    args[1:], kwargs)
    return out


def _stays(me: DTensor, out: Any) -> bool:
    """Whether an in-place op that decided other placements for ``me`` (a ``Partial`` reduced
    first) writes its result back in ``me``'s own placements and memory instead: where views may
    share that memory (views noted, copies of its family, or inside backward, where views go
    unnoted) and the result can be laid out so (never ``Shard`` to ``Partial``)."""
    if not isinstance(out, DTensorSpec) or out.shape != me._spec.shape:
        return False
    if not (me._has_views or me._copies or me._source is not None or torch._C._current_graph_task_id() != -1):
        return False
    sizes = me._spec.mesh.shape
    return not any(isinstance(a, Shard) and isinstance(b, Partial) and sizes[j] > 1
                   for j, (a, b) in enumerate(zip(out.placements, me._spec.placements)))


_HIT_FACTS: dict[int, tuple] = {}
_DETACH = torch.ops.aten.detach.default


def _detach(x: DTensor) -> DTensor:
    """``x.detach()``: the same placements over a detached local tensor, a view of ``x``."""
    out = DTensor(x._local_tensor.detach(), x._spec)
    note_copies(_DETACH, x, False, out)
    return out


def _hit_facts(func) -> tuple:
    """``(may take the hit path, view op, what it writes, the written positions, how its scalars
    are keyed)``, once per op: ops with a rule that write nothing, only their first argument and
    return it, or only tensor lists and return nothing (see ``hit.py``)."""
    view, writes = op_kind(func)
    rule = callable(route(func))  # route first: it marks the ops keyed by scalar sign
    kind = NO_WRITES
    if writes:
        sch = func._schema
        lists = all(str(sch.arguments[i].type) == "List[Tensor]" and not sch.arguments[i].kwarg_only for i in writes)
        kind = (WRITES_SELF if writes == (0,) and _returns_self(func) else
                WRITES_LIST if lists and not sch.returns else -1)
    return rule and kind != -1, view, kind, writes, freezer(func)


def _dispatch_with_plain(func, flat: list, specs: list, treedef, plain: list[int]) -> Any:
    """Dispatch with the plain tensors at ``plain`` taken as replicated values (see ``implicit``).

    An in-place op on a plain ``self`` leaves the whole result in that plain tensor and returns it.
    """
    mesh = next(s.mesh for s in specs if s is not None)
    flat = list(flat)
    plain_self = flat[0] if plain[0] == 0 and _returns_self(func) else None
    drawn = _RANDOM_SAMPLES.get(func)
    for i in plain:
        t = flat[i]
        if drawn is not None and i == len(flat) + drawn:
            t = agreed(t, mesh)  # random numbers the caller drew for the op: the ranks compare them
        elif not implicit_allowed(t):
            if not built_by_torch():
                raise plain_tensor_error(func, t)
            t = agreed(t, mesh)  # built by torch from the op's own arguments: the ranks compare it
        flat[i] = wrap_replicated(t, mesh)
    args, kwargs = unflatten_call(flat, treedef)
    out = dispatch(func, args, kwargs)
    if plain_self is not None:
        full = whole_local(out)
        if full is not plain_self:
            plain_self.copy_(full)
        return plain_self
    return out


_RANDOM_SAMPLES = {torch.ops.aten.fractional_max_pool2d.default: -1, torch.ops.aten.fractional_max_pool3d.default: -1}
"""Ops whose plain tensor argument at this flat position (from the end) is random numbers the caller drew
(``F.fractional_max_pool2d`` draws ``_random_samples`` with ``torch.rand``): ranks may have drawn
different ones, so where they differ coordinate 0's are taken by every rank (a replica must not diverge)."""

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
