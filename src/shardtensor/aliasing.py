"""Views that had to copy stay in step with their base, as views do on one device.

A view op (``view``, ``reshape``, ``squeeze``, ``select``, ``split`` ...) on a DTensor returns a
local view of the same storage whenever the sharded dims survive it, as on one device.  Where
the view needs other ranks' data (a squeezed sharded dim, a reshape that splits a shard across
ranks, the diagonal of a row-sharded matrix), its result is new memory.  Such a copy remembers
its source (the base, the view op and its arguments) and joins the family of the base's root:

- a write into the copy is written back into its source through the view's scatter
  (``diagonal_scatter``, ``slice_scatter``, ``select_scatter``, a reshape or permute back), up
  the chain to the root, so ``x.diagonal().fill_(1)`` and ``x[1] = 5`` change ``x``;
- any write into a member of the family (the root, a true view of it, a copy) refreshes every
  other live copy of the family from its source, oldest first, so a copy never shows stale data.

This holds inside backward too: torch's backward formulas write into views of their temporaries
(``householder_product``'s ``K.diagonal().fill_(1)``).  A view op with no known scatter
(``unfold``, ``expand``) still raises on a write, naming what to do.

The converse: an in-place op that must change its tensor's placements (``x.add_(1)`` on a
``Partial`` tensor reduces it first) gives the tensor new local memory.  When views share the
old storage they would keep the old placements, so such an op raises on a tensor that has views.

Every write is also told to autograd (``note_writes``): the kernel writes local tensors below
autograd, where no version counter moves, and torch bumps a wrapper's counter only for ops with an
in-place autograd kernel (not ``_foreach_*_`` or the fused optimizer steps).  Without the bump, a
tensor saved for backward and then written would give silently wrong gradients.
"""
from __future__ import annotations

import threading
import weakref
from operator import attrgetter
from typing import Any

import torch

from .errors import PropagationError
from .placement import display

__all__ = ["op_kind", "check", "record", "NOTHING", "VIEWS", "COPIES", "OWN"]

aten = torch.ops.aten

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


def check(func: Any, writes: tuple[int, ...], args: tuple, kwargs: dict, me: Any = None, new_spec: Any = None,
          moved: bool = False) -> None:
    """Before ``func`` runs or writes anything: raise where a write would silently not reach where
    it should (``check_writes``), or where it gives ``me`` -- the DTensor self of an in-place op --
    the placements ``new_spec`` (``moved``: new local memory) while views share its storage
    (``check_placement_change``).  Raising then loses nothing."""
    if writes:
        check_writes(func, writes, args, kwargs)
    if me is not None:
        check_placement_change(func, me, new_spec, moved)


NOTHING, VIEWS, COPIES, OWN = 0, 1, 2, 3
"""What an op's results are to its first argument, for ``record``: nothing to mark (new results,
or marked by the ops that built them); views of its storage; copies of it (they needed other
ranks' data); its own new memory although built by views of temporaries (their marks dropped)."""


def record(func: Any, args: tuple, kwargs: dict, out: Any, made: int, writes: tuple[int, ...]) -> Any:
    """After ``func`` ran: mark its results as ``made`` says and tell autograd what it wrote
    (``writes``: the positions); returns ``out``.  The one call dispatch makes after a kernel."""
    if made == VIEWS or made == COPIES:
        note_copies(func, args[0], made == COPIES, out, args[1:], kwargs)
    elif made == OWN:
        forget_copies(out)
    if writes:
        note_writes(func, args, kwargs)
    return out


def note_copies(func: Any, base: Any, moved: bool, out: Any, args: tuple = (), kwargs: dict | None = None) -> None:
    """Mark the DTensor outputs of view op ``func`` (called as ``func(base, *args, **kwargs)``): as
    copies of ``base`` when they do not alias its storage (``moved``: the base was redistributed or
    the kernel gathered, or ``base`` itself is such a copy), else base and outputs as sharing
    storage (outside backward only: nothing there changes placements in place)."""
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
    if _STATE.syncing:
        return  # a refresh's own view of the source: a temporary
    if why is None:
        spec = base._spec
        why = (f"{func} of a DTensor with placements {display(spec.placements, spec.shard_order)} and shape "
               f"{tuple(spec.shape)} needed other ranks' data, so its result is a copy, not a view")
    root = base._base if base._base is not None else base
    many = isinstance(out, (list, tuple))
    for i, o in enumerate(out if many else (out,)):
        if o is not None:
            o._copied_view = why
            o._source = (base, func, tuple(args), dict(kwargs or {}), i if many else None)
            _join(root, o)


def _join(root: Any, copy: Any) -> None:
    """Add ``copy`` to ``root``'s family (a weak reference: the family does not keep it alive)."""
    if root._copies is None:
        root._copies = []
    elif len(root._copies) >= 8:  # a view taken every step: the dead ones go before the list grows
        root._copies = [r for r in root._copies if r() is not None]
    root._copies.append(weakref.ref(copy, _LIVE.drop))
    _LIVE.add()


class _Live:
    """How many copies live in any family: while none does, a write skips the family work."""

    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.n += 1

    def drop(self, _ref: Any = None) -> None:
        with self._lock:
            self.n -= 1


_LIVE = _Live()


class _State(threading.local):
    syncing = False


_STATE = _State()


def forget_copies(out: Any) -> Any:
    """Drop the marks of ``out`` (a non-view op's results that its decomposition built by views of
    its own temporaries: they alias nothing the caller holds)."""
    for o in out if isinstance(out, (list, tuple)) else (out,):
        if getattr(o, "_copied_view", None) is not None:
            o._copied_view = None  # an instance value hides the class default
            o._source = None
        if getattr(o, "_has_views", False):
            o._has_views = False
    return out


def check_writes(func: Any, writes: tuple[int, ...], args: tuple, kwargs: dict) -> None:
    """Raise before ``func`` writes into a copy that cannot be written back (nothing has run yet,
    so nothing is lost)."""
    names = func._schema.arguments
    for i in writes:
        a = args[i] if i < len(args) else kwargs.get(names[i].name)
        for t in a if isinstance(a, (list, tuple)) else (a,):
            why = getattr(t, "_copied_view", None)  # t may be a plain tensor or a number
            if why is not None and not _can_write_back(t):
                raise PropagationError(
                    f"shardtensor: {func} writes into a tensor that is not a view of its base: {why}, and "
                    "shardtensor cannot write it back. The write would not reach the base, and the two would "
                    "silently disagree. Write into the base instead, redistribute the base first so the view "
                    "stays local (e.g. to Replicate), or .clone() the view to write into a copy on purpose")


def _can_write_back(t: Any) -> bool:
    while t._source is not None:
        if t._source[1].overloadpacket not in _BACK:
            return False
        t = t._source[0]
    return t._copied_view is None


def sync(written: Any) -> None:
    """After a write into ``written``: write it back up its chain of copies, then refresh every
    other live copy of its family from its source (see the module note)."""
    root = written._base if written._base is not None else written
    if (written._source is None and not root._copies) or _STATE.syncing:
        return
    _STATE.syncing = True
    try:
        with torch.no_grad():
            chain = {id(written)}
            t = written
            while t._source is not None:
                base = t._source[0]
                base.copy_(_scattered(t))
                chain.add(id(base))
                t = base
            live = []
            for ref in root._copies or ():
                c = ref()
                if c is not None:
                    live.append(ref)
                    if id(c) not in chain:
                        _refresh(c)
            root._copies = live
    finally:
        _STATE.syncing = False


def _refresh(c: Any) -> None:
    """Recompute copy ``c`` from its source, into its own memory (its true views see it)."""
    base, func, args, kwargs, i = c._source
    r = func(base, *args, **kwargs)
    if i is not None:
        r = r[i]
    if r._spec == c._spec:
        c._local_tensor.copy_(r._local_tensor)
    else:
        c._local_tensor, c._spec = r._local_tensor, r._spec


def _scattered(t: Any) -> Any:
    """The value of ``t``'s source with ``t``'s region replaced by ``t``."""
    base, func, args, kwargs, i = t._source
    return _BACK[func.overloadpacket](base, t, args, kwargs, i)


def _split_back(base: Any, t: Any, args: tuple, kwargs: dict, i: Any) -> Any:
    sizes = args[0] if args else kwargs["split_size"] if "split_size" in kwargs else kwargs["split_sizes"]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % base.ndim
    start = sum(sizes[:i]) if isinstance(sizes, (list, tuple)) else sizes * i
    return aten.slice_scatter(base, t, dim, start, start + t.shape[dim])


def _permute_back(base: Any, t: Any, args: tuple, kwargs: dict, i: Any) -> Any:
    dims = [d % base.ndim for d in (args[0] if args else kwargs["dims"])]
    return t.permute(sorted(range(len(dims)), key=dims.__getitem__))


def _reshape_back(base: Any, t: Any, args: tuple, kwargs: dict, i: Any) -> Any:
    return t.reshape(base.shape)


_BACK: dict[Any, Any] = {
    aten.slice: lambda b, t, a, k, i: aten.slice_scatter(b, t, *a, **k),
    aten.select: lambda b, t, a, k, i: aten.select_scatter(b, t, *a, **k),
    aten.diagonal: lambda b, t, a, k, i: aten.diagonal_scatter(b, t, *a, **k),
    aten.as_strided: lambda b, t, a, k, i: aten.as_strided_scatter(b, t, *a, **k),
    aten.unbind: lambda b, t, a, k, i: aten.select_scatter(b, t, a[0] if a else k.get("dim", 0), i),
    aten.split: _split_back, aten.split_with_sizes: _split_back, aten.unsafe_split: _split_back,
    aten.unsafe_split_with_sizes: _split_back,
    aten.transpose: lambda b, t, a, k, i: t.transpose(*a, **k),
    aten.t: lambda b, t, a, k, i: t.t(),
    aten.permute: _permute_back,
    aten.view_as_real: lambda b, t, a, k, i: torch.view_as_complex(t),
    aten.view_as_complex: lambda b, t, a, k, i: torch.view_as_real(t),
    **{p: _reshape_back for p in (aten.view, aten._unsafe_view, aten.reshape, aten.squeeze, aten.unsqueeze,
                                  aten.flatten, aten.unflatten, aten.alias, aten.detach, aten._reshape_alias)},
}
"""View op -> ``(source, copy, the view's other arguments, keyword arguments, output index)`` to
the source's new value: how a write into a copy goes back."""


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
    if _LIVE.n:
        _sync_written(spots, args, kwargs)
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


def _sync_written(spots: tuple, args: tuple, kwargs: dict) -> None:
    """``sync`` each written DTensor (while some copy lives)."""
    for i, name in spots:
        a = args[i] if i < len(args) else kwargs.get(name)
        for t in a if type(a) is list or type(a) is tuple else (a,):
            if hasattr(t, "_local_tensor"):
                sync(t)


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
    # torch leaves the counters alone for ops without an in-place autograd kernel; shardtensor moves
    # them for those that only write (foreach, fused optimizer steps), but not for functional ops
    # that also update buffers (batch norm's running stats): their own backward saved those
    # buffers before the write, and one device's backward runs
    only_writes = all(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)
    r = _BUMPS[id(func)] = (spots, only_writes and not torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), "ADInplaceOrView"))
    return r
