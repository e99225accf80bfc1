"""Dispatch: every aten op on DTensors, top-down, as one pipeline.

1. **Hit** (``hit.py``): a call whose cached decision moves nothing runs as unwrap, kernel, wrap.
2. Else the **full path** chooses how the op runs (``_choose``, where only propagation runs): its
   rule's decision; a decomposition into ops that have rules (an op without a rule, or whose rule
   declines these placements and has ours: ``_fused_sgd_`` with misplaced momentum buffers); the
   inputs' mesh dims no rule reads gathered (``opaque.py``); plain tensors as replicated values where
   ``implicit_replication`` allows them (an error naming the argument elsewhere); on replicated
   inputs (``fallback.py``: visible, exact, off under ``strict_sharding``).
3. **Check** (``aliasing.check``) what the op will write, before anything runs.
4. **Run**: redistribute the inputs the decision requires, run the local kernel, and ``finish``
   (shared with the hit path: wrap the result, or write it into an in-place op's self).
5. **Record** (``aliasing.record``) what the results are to the first argument (views, copies,
   own memory: every path returns that fact) and what was written.

Steps 3 and 5 are the only calls into ``aliasing.py``.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .. import comm
from ..aliasing import COPIES, NOTHING, OWN, VIEWS, check, op_kind, record
from ..errors import MeshMismatchError, UnsupportedOpError
from ..implicit import built_by_torch, implicit_allowed, implicit_replication, plain_tensor_error
from ..listops import is_list_op, run_per_mesh, splits_plain
from ..propagation import flatten_call, propagate, rule_for, unflatten_call
from ..propagation.engine import freezer
from ..redistribute import redistribute_local
from ..rng import agreed
from ..spec import DTensorSpec, placements_text
from ..submesh import off_mesh_result
from ..tensor import DTensor
from .decompose import DECOMPOSITIONS, SELF_BECOMES, Gathered, find_decomposition
from .fallback import check_plain, fallback_allowed, replicate_plain, run_replicated, whole_local, wrap_replicated
from .opaque import dispatch_opaque
from .hit import MISSING, NO_WRITES, WRITES_LIST, WRITES_SELF, finish, hit, keeps_placements

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


def dispatch(func, args: tuple, kwargs: dict) -> Any:
    """The hit path (``hit.py``), else the full path; then what the op made and wrote is recorded
    (``aliasing.record``, the one call after a kernel, as ``aliasing.check`` is the one before)."""
    if func is _DETACH and type(args[0]) is DTensor:  # autograd detaches every gradient it accumulates
        return record(func, args, kwargs, DTensor(args[0]._local_tensor.detach(), args[0]._spec), VIEWS, ())
    facts = _HIT_FACTS.get(id(func))
    if facts is None:
        facts = _HIT_FACTS[id(func)] = _hit_facts(func)
    out = hit(func, args, kwargs, facts[2], facts[3], facts[4]) if facts[0] else MISSING
    if out is MISSING:
        out, made = _full(func, args, kwargs, facts[1] == VIEWS, facts[3])
    else:
        made = facts[1]  # the hit path takes no decision whose views are copies
    if made or facts[3]:
        record(func, args, kwargs, out, made, facts[3])
    return out


def _full(func, args: tuple, kwargs: dict, view: bool, writes: tuple) -> tuple[Any, int]:
    """The full path: how ``func`` runs (``_choose``: nothing but propagation runs there), checked
    before anything runs or is written (``aliasing.check``), then run.  Returns the result and
    what it is to the first argument (``aliasing.NOTHING``, ``VIEWS`` ...), for ``record``."""
    flat, treedef = flatten_call(args, kwargs)
    specs, plain, first, packed = _scan(func, flat)
    what: Any = None
    if plain is not None and splits_plain(func, args):  # plain list elements run as plain tensors
        how = _PER_MESH
    else:
        how, what = _choose(func, flat, specs, treedef, plain, packed, first)
    keep = False
    if writes:
        me, new, moved, keep = _self_change(func, how, what, flat, specs, first)
        check(func, writes, args, kwargs, me, new, moved)
    if how is _DIRECT:
        return _direct(func, what, flat, specs, treedef, view, keep, not writes)
    if how is _DECOMPOSE:
        return _decompose(func, what, args, kwargs, view, writes)
    out = (dispatch_opaque(func, args, kwargs, flat, specs, treedef, _returns_self(func), dispatch)
           if how is _PACKED else
           _dispatch_with_plain(func, flat, specs, treedef, what) if how is _PLAIN else
           run_per_mesh(func, args, kwargs, dispatch, DTensor) if how is _PER_MESH else
           run_replicated(func, args, kwargs, _returns_self(func)) if how is _FALLBACK else
           off_mesh_result(func, what.output, flat[0], first._local_tensor.device, first.dtype,  # type: ignore[union-attr]
                           _returns_self(func), DTensor))
    copied = view and (how is _PACKED or how is _FALLBACK) and isinstance(args[0], DTensor)
    return out, COPIES if copied else NOTHING  # views of the gathered copy, not of the input


_DIRECT, _DECOMPOSE, _PACKED, _PLAIN, _PER_MESH, _FALLBACK, _OFF_MESH = (
    "rule", "decomposition", "packed", "plain", "per mesh", "fallback", "off mesh")
"""How the full path runs an op: its rule's decision; a decomposition into ops that have rules;
gathered where no rule reads a placement (``opaque.py``); with plain tensors as replicated values; per mesh
(list ops over tensors on several meshes, or over DTensors and plain tensors); on replicated
inputs (``fallback.py``); on a rank outside the mesh (nothing runs)."""


def _scan(func, flat: list) -> tuple[list[DTensorSpec | None], list[int] | None, DTensor | None, bool]:
    """``(spec of each flat argument, positions of plain tensors taken as values, the first
    DTensor, whether any is packed)``."""
    specs: list[DTensorSpec | None] = []
    plain: list[int] | None = None
    first: DTensor | None = None
    packed = False
    for i, a in enumerate(flat):
        if isinstance(a, DTensor):
            specs.append(a._spec)
            packed = packed or a._spec.opaque
            if first is None:
                first = a
        else:
            if isinstance(a, torch.Tensor) and a.ndim > 0:  # a plain tensor with dims (check_plain), inlined: the hot loop
                plain = (plain or []) + [i]
            specs.append(None)
    if specs and specs[0] is None and type(flat[0]) is torch.Tensor and flat[0].ndim == 0 and _returns_self(func):
        plain = [0] + (plain or [])  # a plain 0-d self written in place (``total.add_(dt.sum())``) takes the value
    return specs, plain, first, packed


def _choose(func, flat: list, specs: list, treedef, plain: list[int] | None, packed: bool,
            first: DTensor | None) -> tuple[str, Any]:
    """``(how, what)``: how the full path runs ``func`` (``_DIRECT`` ...) and with what (the
    decision, the decomposition, the plain positions)."""
    if packed:  # a placement no rule reads (``opaque.py``)
        return _PACKED, None
    r = route(func)
    if isinstance(r, tuple):
        return _DECOMPOSE, r[1]
    if plain is not None:
        return _PLAIN, plain
    try:
        decision = propagate(func, flat, specs, treedef)
    except MeshMismatchError:
        if not is_list_op(func):
            raise
        return _PER_MESH, None
    except UnsupportedOpError as e:
        if e.op is not func:
            raise
        fn = DECOMPOSITIONS.get(func)  # a rule that declines these placements: our decomposition, if any
        if fn is not None:
            return _DECOMPOSE, fn
        if not fallback_allowed(func):
            raise
        return _FALLBACK, None
    # a rank outside the mesh holds an empty (or 0-d placeholder) local tensor and runs nothing; the
    # size test first keeps the rank lookup off the hot path
    if first is not None and first._local_tensor.numel() <= 1 and first._spec.mesh._coord is None:
        return _OFF_MESH, decision
    return _DIRECT, decision


def _self_change(func, how: str, what: Any, flat: list, specs: list,
                 first: DTensor | None) -> tuple[DTensor | None, Any, bool, bool]:
    """For an op that writes: ``(self, the spec it would take, whether it takes new local memory,
    whether it keeps its placements)`` where it is a DTensor an in-place op may give other
    placements (its rule decided them, or its decomposition says: ``SELF_BECOMES``), else
    ``(None, None, False, keep)``."""
    me = flat[0]
    becomes = SELF_BECOMES.get(func) if how is _DECOMPOSE else None
    if becomes is not None and isinstance(me, DTensor):
        new = becomes(me)
        return me, new, new != me._spec, False
    if how is not _DIRECT or first is None or first is not me or not _returns_self(func):
        return None, None, False, False
    if keeps_placements(first._spec, what.output) or _stays(first, what.output):
        return None, None, False, True
    w = what.inputs[0]
    return first, what.output, bool(what.redistribute and w is not None and w != specs[0]), False


def _direct(func, decision: Any, flat: list, specs: list, treedef, view: bool, keep: bool,
            reuse: bool) -> tuple[Any, int]:
    """Redistribute, run the local kernel, finish (``hit.finish``, shared with the hit path);
    ``reuse``: the op writes nothing, so it may share moved inputs (``_Moves``)."""
    if not decision.redistribute:
        local = [a if s is None else a._local_tensor for a, s in zip(flat, specs)]
    elif comm.listening():
        with comm.scope(str(func)):
            local = _local_args(flat, specs, decision, reuse)
    else:
        local = _local_args(flat, specs, decision, reuse)
    if decision.local_args is not None:
        local = decision.local_args(local)
    largs, lkwargs = unflatten_call(local, treedef)
    out = (decision.kernel or func)(*largs, **lkwargs)
    out = finish(out, decision.output, flat[0] if _returns_self(func) else None, local[0], keep)
    if not view:
        return out, NOTHING
    w = decision.inputs[0]
    moved = decision.copies or (decision.redistribute and w is not None and w != specs[0])
    return out, COPIES if moved else VIEWS


def _decompose(func, fn, args: tuple, kwargs: dict, view: bool, writes: tuple) -> tuple[Any, int]:
    """``func`` computed by its decomposition ``fn``; where that fails before writing anything, on
    replicated inputs (``fallback.py``), else an error naming the op and the placements."""
    check_plain(func, tree_flatten((args, kwargs))[0])
    try:
        with implicit_replication(), _MOVES:  # plain tensors the decomposition builds are the same on every rank
            out = replicate_plain(fn(*args, **kwargs), args, kwargs)
    except NotImplementedError as e:
        if isinstance(e, UnsupportedOpError) and e.op == func:
            raise
        if not writes and fallback_allowed(func):  # nothing was written: safe to run it whole
            out = run_replicated(func, args, kwargs, False)
            return out, COPIES if view and isinstance(args[0], DTensor) else NOTHING
        pls = placements_text([a._spec for a in tree_flatten((args, kwargs))[0] if isinstance(a, DTensor)])
        raise UnsupportedOpError(f"shardtensor: {func} has no sharding rule for these placements and its "
                                 f"decomposition failed (input placements: {pls}): {e}", func) from e
    if type(out) is Gathered:  # views of a gathered copy of the input
        return tuple(out), COPIES
    return out, NOTHING if view else OWN  # a view's results were marked by the views that built them; a
    # non-view op's results are its own memory


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
    return not any(a.is_shard() and b.is_partial() and sizes[j] > 1
                   for j, (a, b) in enumerate(zip(out.placements, me._spec.placements)))


_HIT_FACTS: dict[int, tuple] = {}
_DETACH = torch.ops.aten.detach.default


def _hit_facts(func) -> tuple:
    """``(may take the hit path, what its results are on that path (``VIEWS`` or ``NOTHING``), what
    it writes, the written positions, how its scalars are keyed)``, once per op: ops with a rule that write nothing, only their first argument and
    return it, or only tensor lists and return nothing (see ``hit.py``)."""
    view, writes = op_kind(func)
    rule = callable(route(func))  # route first: it marks the ops keyed by scalar sign
    kind = NO_WRITES
    if writes:
        sch = func._schema
        lists = all(str(sch.arguments[i].type) == "List[Tensor]" and not sch.arguments[i].kwarg_only for i in writes)
        kind = (WRITES_SELF if writes == (0,) and _returns_self(func) else
                WRITES_LIST if lists and not sch.returns else -1)
    return rule and kind != -1, VIEWS if view else NOTHING, kind, writes, freezer(func)


def _dispatch_with_plain(func, flat: list, specs: list, treedef, plain: list[int]) -> Any:
    """Dispatch with the plain tensors at ``plain`` taken as replicated values (see ``implicit``).

    An in-place op on a plain ``self`` leaves the whole result in that plain tensor and returns it.
    Where every DTensor is replicated and ``self`` is not a replicated value, the op runs on plain
    tensors with their local values (``clip_grad_norm_(foreach=False)`` scaling a TP model's plain
    gradients by its DTensor coefficient): what the foreach op does for plain elements (``listops``).
    """
    mesh = next(s.mesh for s in specs if s is not None)
    flat = list(flat)
    plain_self = flat[0] if plain[0] == 0 and _returns_self(func) else None
    if plain_self is not None and not implicit_allowed(plain_self) and all(
            s is None or all(p.is_replicate() for p in s.placements) for s in specs):
        args, kwargs = unflatten_call([a._local_tensor if isinstance(a, DTensor) else a for a in flat], treedef)
        return func(*args, **kwargs)
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


class _Moves(threading.local):
    """The inputs a decomposition's ops moved, per rank thread, while it runs: where several of
    its ops need one input in the same placements (``logsigmoid``'s ``minimum`` and ``abs`` each
    reduce a Partial ``x``), it moves once.  Keyed by the local tensor and its version, reused
    only while the moved copy is unwritten; ops that write take no part."""

    depth = 0
    memo: dict | None = None

    def __enter__(self) -> None:
        self.depth += 1
        if self.depth == 1:
            self.memo = {}

    def __exit__(self, *exc: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.memo = None

    def moved(self, t: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
        memo = self.memo
        if memo is None:
            return redistribute_local(t, src, dst)
        key = (id(t), t._version, src, dst)
        seen = memo.get(key)
        if seen is not None and seen[1]._version == seen[2]:
            return seen[1]
        out = redistribute_local(t, src, dst)
        memo[key] = (t, out, out._version)  # t held: its id stays this tensor's while the memo lives
        return out


_MOVES = _Moves()


def _local_args(flat: list, specs: list, decision, reuse: bool = False) -> list:
    """Local tensors of the arguments, redistributed where the decision requires."""
    local = []
    move = _MOVES.moved if reuse else redistribute_local
    for a, s, want in zip(flat, specs, decision.inputs):
        if s is None:
            local.append(a)
        elif decision.redistribute and want is not None and want != s:
            local.append(move(a._local_tensor, s, want))
        else:
            local.append(a._local_tensor)
    return local
