"""Views that had to copy: a write through one raises instead of silently missing its base.

A view op (``view``, ``reshape``, ``squeeze``, ``select``, ``split`` ...) on a DTensor returns a
local view of the same storage whenever the sharded dims survive it, as on one device.  Where
the view needs other ranks' data (a squeezed sharded dim, a reshape that splits a shard across
ranks), its result is new memory: reading it is right, but an in-place op on it would not reach
the base, and base and view would silently disagree.  Such results, and views of them, carry a
note; an op that writes into one raises ``RuntimeError`` saying what happened and what to do.

Autograd's backward pass makes views of gradients that later accumulate in place; those carry
no note (nothing in user code aliases them).

The converse: an in-place op that must change its tensor's placements (``x.add_(1)`` on a
``Partial`` tensor reduces it first) gives the tensor new local memory.  When views share the
old storage they would keep the old placements, so such an op raises on a tensor that has views.

Every write is also told to autograd (``note_writes``): the kernel writes local tensors below
autograd, where no version counter moves, and torch bumps a wrapper's counter only for ops with an
in-place autograd kernel (not ``_foreach_*_`` or the fused optimizer steps).  Without the bump, a
tensor saved for backward and then written would give silently wrong gradients.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch

from .errors import PropagationError
from .placement import display

__all__ = ["op_kind", "note_copies", "forget_copies", "check_writes", "check_placement_change", "note_writes"]

_KIND: dict[int, tuple[bool, tuple[int, ...]]] = {}


def op_kind(func: Any) -> tuple[bool, tuple[int, ...]]:
    """``(is a view op, schema positions of the arguments it writes)``, once per op."""
    k = _KIND.get(id(func))
    if k is None:
        sch = func._schema
        args = sch.arguments
        view = bool(sch.returns and args and args[0].alias_info is not None and not args[0].alias_info.is_write
                    and all(r.alias_info is not None and not r.alias_info.is_write for r in sch.returns))
        writes = tuple(i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
        k = _KIND[id(func)] = (view, writes)
    return k


def note_copies(func: Any, base: Any, moved: bool, out: Any) -> None:
    """Mark the DTensor outputs of view op ``func``: as copies when they do not alias ``base``'s
    storage (``moved``: the base was redistributed or the kernel gathered, or ``base`` itself is
    such a copy), else base and outputs as sharing storage.  Nothing is marked inside backward."""
    why = base._copied_view
    if why is None and not moved:
        if torch._C._current_graph_task_id() == -1:
            base._has_views = True
            if type(out) is not list and type(out) is not tuple:
                out._has_views = True
            else:
                for o in out:
                    if o is not None:
                        o._has_views = True
        return
    if why is None:
        if torch._C._current_graph_task_id() != -1:
            return
        spec = base._spec
        why = (f"{func} of a DTensor with placements {display(spec.placements, spec.shard_order)} and shape "
               f"{tuple(spec.shape)} needed other ranks' data, so its result is a copy, not a view")
    for o in out if isinstance(out, (list, tuple)) else (out,):
        if o is not None:
            o._copied_view = why


def forget_copies(out: Any) -> Any:
    """Drop the marks of ``out`` (a non-view op's results that its decomposition built by views of
    its own temporaries: they alias nothing the caller holds)."""
    for o in out if isinstance(out, (list, tuple)) else (out,):
        if getattr(o, "_copied_view", None) is not None:
            o._copied_view = None  # an instance value hides the class default
        if getattr(o, "_has_views", False):
            o._has_views = False
    return out


def check_writes(func: Any, writes: tuple[int, ...], args: tuple, kwargs: dict) -> None:
    """Raise before ``func`` writes into a noted copy (nothing has run yet, so nothing is lost)."""
    names = func._schema.arguments
    for i in writes:
        a = args[i] if i < len(args) else kwargs.get(names[i].name)
        for t in a if isinstance(a, (list, tuple)) else (a,):
            why = getattr(t, "_copied_view", None)  # t may be a plain tensor or a number
            if why is not None:
                raise PropagationError(
                    f"shardtensor: {func} writes into a tensor that is not a view of its base: {why}. The write "
                    "would not reach the base, and the two would silently disagree. Write into the base instead, "
                    "redistribute the base first so the view stays local (e.g. to Replicate), or .clone() the "
                    "view to write into a copy on purpose")


def check_placement_change(func: Any, me: Any, new_spec: Any, moved: bool) -> None:
    """Raise before an in-place op gives ``me`` new placements (new local memory) while it shares
    storage with views: they would keep the old placements and data and silently disagree."""
    if not me._has_views:
        return
    if not moved and (new_spec is None or new_spec.placements == me._spec.placements):
        return
    old = display(me._spec.placements, me._spec.shard_order)
    new = display(new_spec.placements, new_spec.shard_order) if new_spec is not None else "other placements"
    raise PropagationError(
        f"shardtensor: {func} on a DTensor with placements {old} would make it {new}, but it shares storage "
        "with views that would keep the old placements and silently disagree. Redistribute it first "
        f"(e.g. x = x.redistribute(mesh, [Replicate()] * mesh.ndim)) or use the out-of-place op")


_BUMPS: dict[int, tuple[tuple[tuple[int, str], ...], bool]] = {}


def note_writes(func: Any, args: tuple, kwargs: dict) -> None:
    """Move the version counters of what ``func`` wrote, after it ran: each written DTensor's
    local tensor, and the written tensors themselves where torch does not (see the module note)."""
    spots, wrappers = _BUMPS.get(id(func)) or _bumps(func)
    if spots is _SELF and not wrappers and args:  # x.add_(y): the hot case
        local = getattr(args[0], "_local_tensor", None)
        if local is not None:
            _bump((local,))
        return
    for i, name in spots:
        a = args[i] if i < len(args) else kwargs.get(name)
        if type(a) is list or type(a) is tuple:
            try:  # the common case: DTensors only
                _bump(list(map(_LOCAL, a)))
            except AttributeError:  # plain tensors among them
                _bump([t._local_tensor for t in a if hasattr(t, "_local_tensor")])
            if wrappers:
                _bump(a)
        elif isinstance(a, torch.Tensor):
            local = getattr(a, "_local_tensor", None)
            if local is not None:
                _bump((local,))
            if wrappers:
                _bump((a,))


_SELF = ((0, "self"),)
_bump = torch._C._increment_version
"""``torch.autograd.graph.increment_version`` without its Python layer (a sequence of tensors; a
tensor itself would be iterated row by row)."""
_LOCAL = attrgetter("_local_tensor")


def _bumps(func: Any) -> tuple[tuple[tuple[int, str], ...], bool]:
    """``((position, name) of each written argument, whether torch leaves the wrappers' counters
    alone)``, once per op."""
    names = func._schema.arguments
    spots = tuple((i, names[i].name) for i in op_kind(func)[1])
    spots = _SELF if spots == _SELF else spots
    r = _BUMPS[id(func)] = (spots, not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "ADInplaceOrView"))
    return r
