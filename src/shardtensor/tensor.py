"""DTensor: a torch.Tensor subclass holding one rank's local piece and the global spec.

``__torch_dispatch__`` is the pipeline entry: propagation decides the placements, the
executor redistributes inputs that must move, the plain local kernel runs, and the outputs
are wrapped with the decided specs.  Autograd flows through ``from_local``, ``to_local`` and
``redistribute`` (autograd Functions below); every other op's backward dispatches here too.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from . import blocks, comm
from .comm.generators import draws_itself
from .compile import in_graph, keep_dynamo_out, metadata, stable_hash
from .implicit import TORCH_FUNCTION_CODES
from .mesh import DeviceMesh, resolve_mesh
from .pieces import check_partial_dtype, check_pieces, check_shape, layout_stride, local_order
from .placement import (ORDERED, OrderedPlacements, Partial, Placement, Replicate, display, normalize_placements,
                        partial_op, split_local, unpartial)
from .redistribute import redistribute_local
from .redistribute.move import cross_target, relocate
from .spec import DTensorSpec, interned
from .submesh import empty_local

__all__ = ["DTensor", "distribute_tensor", "install_dispatch"]


def _tensor_attribute(name: str, writable: bool = True, plain_to: Any = None) -> Any:
    """``torch.Tensor``'s attribute ``name`` on a DTensor, read (and written) by torch's own getter
    with subclass torch-function handling off.  Through ``DTensor.__torch_function__`` a read
    costs about 1.3 us, this way 0.35 us; torch-function modes still see it.  ``plain_to(self,
    value)`` replaces a value that is a plain tensor (and is stored in its place)."""
    desc = getattr(torch._C.TensorBase, name)

    def get(self: Any) -> Any:
        with _NO_SUBCLASS_FUNCTIONS():
            v = desc.__get__(self)
            if plain_to is None or v is None or type(v) is DTensor:
                return v
            v = plain_to(self, v)
            desc.__set__(self, v)
            return v

    def put(self: Any, value: Any) -> None:
        with _NO_SUBCLASS_FUNCTIONS():
            desc.__set__(self, value)

    def drop(self: Any) -> None:
        with _NO_SUBCLASS_FUNCTIONS():
            desc.__delete__(self)

    return property(get, put if writable else None, drop if writable else None, doc=getattr(desc, "__doc__", None))


_NO_SUBCLASS_FUNCTIONS = torch._C.DisableTorchFunctionSubclass

below: Callable[..., Any] = torch._C._disabled_torch_function_impl
"""``below(func, types, args[, kwargs])``: ``func`` run with torch-function handling off for
DTensors (torch's C++ implementation of exactly that; ``kwargs`` only when not empty, since a
property getter takes none)."""


def _not_installed(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("shardtensor's dispatch layer is not installed: import shardtensor (the package installs it)")


# Where the layer that runs ops plugs into DTensor (``install_dispatch``): DTensor sits below that
# layer, so it cannot import it.  The package imports the layer, so users never meet these.
_dispatch: Callable[..., Any] = _not_installed
_torch_function: Callable[..., Any] = _not_installed
_finish: Callable[..., Any] = _not_installed
_repaired: frozenset = frozenset()


def install_dispatch(dispatch: Callable[..., Any], torch_function: Callable[..., Any], finish: Callable[..., Any],
                     repaired: frozenset) -> None:
    """Plug in the dispatch layer: ``dispatch(func, args, kwargs)`` runs every aten op on DTensors,
    ``torch_function`` the torch functions in ``repaired`` (and calls mixing subclasses), and
    ``finish`` repairs the result of the others."""
    global _dispatch, _torch_function, _finish, _repaired
    _dispatch, _torch_function, _finish, _repaired = dispatch, torch_function, finish, repaired


def _as_dtensor_grad(param: "DTensor", g: Any) -> Any:
    """A plain gradient autograd left on a DTensor (torch's backward formulas build zero gradients
    with a factory: ``copysign``'s ``other``, ``normal``'s ``mean``) is the whole value, the same on
    every rank: taken as such, laid out as the parameter."""
    if not isinstance(g, torch.Tensor) or isinstance(g, DTensor) or tuple(g.shape) != tuple(param._spec.shape):
        return g
    spec = param._spec.with_dtype(g.dtype)
    return DTensor(redistribute_local(g, spec.with_placements([Replicate()] * spec.mesh.ndim), spec), spec)
_function_modes = torch._C._is_torch_function_mode_enabled


class DTensor(torch.Tensor):
    """A global tensor stored as local shards over a DeviceMesh."""

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    __slots__ = ("_local_tensor", "_spec")
    _copied_view: str | None = None  # set on views that had to copy (see aliasing.py); a class default
    _has_views: bool = False  # reads fast where unset, unlike an empty slot
    _source: tuple | None = None  # a copy's (base, view op, args, kwargs, output index) (aliasing.py)
    _copies: list | None = None  # weak references to the copies of a root's family (aliasing.py)
    _flat_meta: tuple | None = None  # ``__tensor_flatten__``'s (spec, rank), made on its first call

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False) -> "DTensor":
        r = torch.Tensor._make_wrapper_subclass(
            cls, spec.shape, strides=spec.stride, dtype=spec.dtype, device=local_tensor.device,
            layout=local_tensor.layout, requires_grad=requires_grad,
        )
        r._local_tensor = local_tensor
        r._spec = spec
        return r

    def __repr__(self) -> str:  # type: ignore[override]  # noqa: D105
        return (f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
                f"placements={self.placements!r})")

    # autograd's attributes that optimizers, zero_grad and clip_grad_norm_ read per parameter:
    # torch's own getters and setters without a torch-function call (nothing to repair there)
    grad = _tensor_attribute("grad", plain_to=lambda self, g: _as_dtensor_grad(self, g))
    requires_grad = _tensor_attribute("requires_grad")
    is_leaf = _tensor_attribute("is_leaf", writable=False)
    is_sparse = _tensor_attribute("is_sparse", writable=False)

    def to(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """``Tensor.to``.  A move to the device the tensor is already on returns the tensor itself,
        as torch does, without a torch-function call (``clip_grad_norm_`` makes one per parameter);
        every other call, and every call under a torch-function mode or ``torch.compile``, is
        torch's."""
        if (len(args) == 1 and not kwargs and type(args[0]) is torch.device and args[0] == self._local_tensor.device
                and not _function_modes() and not torch.compiler.is_compiling()):
            return self
        return super().to(*args, **kwargs)

    # -- public surface -----------------------------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        """The placements; with a nested shard order other than the default, an
        ``OrderedPlacements`` whose repr shows it (equal to the plain tuple)."""
        spec = self._spec
        if all(len(js) == 1 for _, js in spec.shard_order) or spec.is_default_order:
            return spec.placements
        return OrderedPlacements(spec.placements, spec.shard_order)

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def shard_order(self):
        return self._spec.shard_order

    @staticmethod
    @in_graph
    def from_local(local_tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                   placements: Sequence[Placement] | None = None, *, run_check: bool | None = None,
                   shape: Sequence[int] | None = None, stride: Sequence[int] | None = None) -> "DTensor":
        """Wrap each rank's ``local_tensor`` as the shards of one global tensor.

        Without ``shape`` and with a dim sharded, the ranks' local shapes are gathered (one small
        all-gather) so uneven pieces get their real global shape and pieces no global shape explains
        raise the same error on every rank.  That exchange is a collective (and a host sync on
        GPUs), so in hot loops pass ``shape=``, or ``run_check=False`` to assume even pieces (local
        size times the mesh size) with no communication, as torch's DTensor does.
        ``run_check=True`` always checks the pieces and broadcasts replicated data from rank 0.
        """
        if not isinstance(local_tensor, torch.Tensor) or isinstance(local_tensor, DTensor):
            raise TypeError(f"from_local needs a local torch.Tensor, got {type(local_tensor).__name__}")
        device_mesh = resolve_mesh(device_mesh, "from_local")
        key = _wrap_key(local_tensor, device_mesh, placements, run_check, shape, stride)
        try:
            seen = _WRAPPED.get(key) if key is not None else None
        except TypeError:  # an unhashable argument: not cached (the checks below say what is wrong)
            key = seen = None
        if seen is not None:  # the same call on this rank before: the same spec, no checks to repeat
            return _FromLocal.apply(local_tensor, seen[1], False)
        if placements is None:
            placements = [Replicate()] * device_mesh.ndim
        pl = normalize_placements(placements, local_tensor.ndim, device_mesh.ndim)
        check_partial_dtype(pl, local_tensor.dtype)
        sharded = any(p.tensor_dim() is not None for p in pl)
        order = None  # the global dim order, from the pieces when they are gathered
        if shape is not None:
            shape = check_shape(shape, local_tensor)
        member = device_mesh.get_coordinate() is not None  # ranks outside the mesh take no part
        g: list[int | None] = [int(n) for n in local_tensor.shape]  # (int(): symbolic sizes under torch.compile)
        for j, p in enumerate(pl):  # the even assumption, where a placement can make it
            d = p.tensor_dim()
            if d is not None and g[d] is not None:
                g[d] = p.global_length(g[d], device_mesh.size(j))  # type: ignore[arg-type]
        guessed = None if any(n is None for n in g) else tuple(n for n in g if n is not None)
        gathered = member and (run_check or (run_check is None and (shape is None and sharded or guessed is None))
                               or (shape is None and guessed is None))  # uneven by design: checked unless told not
        if gathered:
            shape, order = check_pieces(local_tensor, device_mesh, pl, shape)
        elif shape is None:
            if guessed is None:
                raise ValueError(f"from_local: placements {display(pl)} do not give the global shape from one piece; "
                                 "pass shape=")
            shape = guessed
        assert shape is not None
        if stride is None:
            stride = layout_stride(shape, local_order(local_tensor) if order is None else order)
        spec = DTensorSpec.build(device_mesh, pl, shape, stride, local_tensor.dtype)
        if not member:  # hold nothing (differentiably)
            local_tensor = local_tensor.reshape(-1)[:0] if spec.ndim else local_tensor.reshape(-1)[:0].sum()
        else:
            expect = spec.local_shape
            if tuple(local_tensor.shape) != expect:
                raise ValueError(
                    f"from_local: rank {device_mesh.get_rank()} holds local shape {tuple(local_tensor.shape)} but global "
                    f"shape {tuple(spec.shape)} with {display(pl)} gives it {expect}"
                )
            if key is not None and not gathered:  # no collective ran: the call may be cached
                if len(_WRAPPED) >= 1024:
                    _WRAPPED.clear()
                _WRAPPED[key] = (device_mesh, spec)
        return _FromLocal.apply(local_tensor, spec, bool(run_check) and member)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's local shard (autograd: the gradient comes back with ``grad_placements``, by
        default each placement's ``local_grad()``: the gradient of the global value)."""
        if not (torch.is_grad_enabled() and self.requires_grad):
            return self._local_tensor
        return _ToLocal.apply(self, grad_placements)

    # torch.distributed.checkpoint's protocol for tensor subclasses (see blocks.py)
    def __create_write_items__(self, fqn: str, object: Any) -> list:
        return blocks.write_items(fqn, self._spec, self._local_tensor)

    def __create_chunk_list__(self) -> list:
        return blocks.chunk_list(self._spec)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return blocks.local_block(self._spec, self._local_tensor, index)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (redistributes to Replicate)."""
        rep = self.redistribute(self.device_mesh, [Replicate()] * self.device_mesh.ndim)
        return rep.to_local(grad_placements=grad_placements)

    def redistribute(self, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None, *,
                     async_op: bool = False, forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None,
                     shard_order: dict[int, Sequence[int]] | None = None) -> "DTensor":
        """A DTensor with the same value and new placements (differentiable).

        Targets may be Partial only where the source already is that Partial.  A ``device_mesh``
        other than this one moves the tensor there by point-to-point pieces (docs/meshes.md).
        ``shard_order={tensor_dim: [mesh dims, first-applied first]}`` picks a non-default
        nested order.  ``async_op=True`` leaves the last collective in flight: the result's
        local tensor is an ``AsyncLocalTensor`` that waits on first use (``.wait()`` on it, or any
        op on the DTensor), so communication overlaps with whatever runs in between.
        """
        mesh = device_mesh if device_mesh is not None else self.device_mesh
        for name, dt in (("forward_dtype", forward_dtype), ("backward_dtype", backward_dtype)):
            if dt is not None and not isinstance(dt, torch.dtype):
                raise TypeError(f"redistribute: {name} must be a torch.dtype (e.g. torch.float16) or None, got {dt!r}")
        if placements is None:
            raise RuntimeError("redistribute needs placements")
        order = None if shard_order is None else _shard_order_arg(shard_order)
        if mesh != self.device_mesh:  # another mesh: point-to-point pieces (redistribute/crossmesh.py)
            return _Redistribute.apply(self, cross_target(self._spec, mesh, placements, order), forward_dtype,
                                       backward_dtype, False)
        target = self._spec.with_placements(placements, order)
        for j, (p, cur) in enumerate(zip(target.placements, self.placements)):
            if p.is_partial() and p != cur:
                raise RuntimeError(
                    f"redistributing to {p!r} on mesh dim {j} (currently {cur!r}) is for internal use only"
                )
        return _Redistribute.apply(self, target, forward_dtype, backward_dtype, async_op)

    # -- dispatch -----------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """torch's default handling, with repairs where torch's C++ works outside dispatch
        (``dispatch/functions.py``)."""
        if func in _repaired or len(types) != 1 or types[0] is not cls:
            if not all(issubclass(cls, t) for t in types):
                return NotImplemented
            return _torch_function(func, types, args, kwargs)
        out = below(func, types, args, kwargs) if kwargs else below(func, types, args)
        return out if type(out) is DTensor else _finish(func, out, args, kwargs)

    # -- torch.compile (see compile.py): the metadata is the spec and the calling rank ----
    def __tensor_flatten__(self):
        self._flat_meta = meta = metadata(self)
        return ["_local_tensor"], meta

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return DTensor(inner["_local_tensor"], meta[0], requires_grad=inner["_local_tensor"].requires_grad)

    @classmethod
    def __metadata_guard__(cls, orig, other) -> bool:
        return orig[1] == other[1] and orig[0] == other[0]

    def _stable_hash_for_caching(self) -> str:
        """Key of torch.compile's on-disk caches: everything a trace depends on, the rank and
        shardtensor's version included (a newer planner may trace the same call differently)."""
        return stable_hash(self._spec, self._local_tensor)

    def __coerce_tangent_metadata__(self) -> "DTensor":
        """The layout AOTAutograd expects this output's gradient in: Partial reduced (a
        gradient arrives whole, as ``backward()`` on a replicated loss gives it)."""
        return self._moved_to(self._spec.unpartial())

    def __coerce_same_metadata_as_tangent__(self, meta, expected_type=None) -> "DTensor | None":
        """A gradient that arrived in another layout, moved to the one the compiled backward expects."""
        if expected_type is not None:
            return None
        want: DTensorSpec = meta[0]
        return self._moved_to(self._spec.with_placements(want.placements, want.shard_order))

    def _moved_to(self, target: DTensorSpec) -> "DTensor":
        if target == self._spec:
            return self
        return DTensor(redistribute_local(self._local_tensor, self._spec, target), target)


keep_dynamo_out()


def _shard_order_arg(shard_order: Any) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``redistribute``'s ``shard_order=``: ``{tensor dim: [mesh dims]}`` or pairs ``[(dim, [mesh dims])]``."""
    pairs = shard_order.items() if isinstance(shard_order, dict) else shard_order
    try:
        out = tuple((d, tuple(js)) for d, js in pairs)
    except (TypeError, ValueError):
        out = None
    if out is None or not all(isinstance(d, int) and all(isinstance(j, int) for j in js) for d, js in out):
        raise TypeError("redistribute: shard_order must map tensor dims to lists of mesh dims, e.g. {0: [1, 0]} "
                        f"(or pairs [(0, [1, 0])]), got {shard_order!r}")
    return out


_WRAPPED: dict[tuple, tuple[DeviceMesh, DTensorSpec]] = {}
"""``from_local`` calls that ran no collective -> ``(the mesh, their spec)``.  Such a spec follows
from the key alone: the mesh, this rank's coordinate, the arguments, and the local tensor's shape,
strides and dtype.  TP styles wrap every module input each step.  The key holds the mesh by id, so
the entry holds the mesh itself: its id cannot pass to another mesh while the entry lives (the
spec may hold an equal mesh built earlier, not this one)."""


def _wrap_key(local: torch.Tensor, mesh: DeviceMesh, placements: Any, run_check: Any, shape: Any,
              stride: Any) -> tuple | None:
    """``_WRAPPED``'s key of a ``from_local`` call, or ``None`` where the rank is outside the mesh
    or an argument is not a sequence."""
    coord = mesh._coord
    if coord is None:
        return None
    try:
        return (id(mesh), coord, None if placements is None else tuple(placements), local.shape, local.stride(),
                local.dtype, run_check, None if shape is None else tuple(shape),
                None if stride is None else tuple(stride))
    except TypeError:
        return None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, run_check: bool) -> DTensor:
        ctx.spec = spec
        out = local.view_as(local)
        if run_check:
            for j, p in enumerate(spec.placements):
                if p.is_replicate():
                    out = comm.broadcast(out, 0, spec.mesh, j)
        return DTensor(out, spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        spec: DTensorSpec = ctx.spec
        if not isinstance(grad, DTensor):
            return grad, None, None
        kinds = {op for p in spec.placements if (op := partial_op(p)) is not None}
        if kinds - {"sum", "avg"}:
            raise NotImplementedError(f"backward of from_local with {display(spec.placements)} (Partial {sorted(kinds)})")
        gspec = grad._spec  # (not grad.shape and the like: each would be a torch-function call)
        target = DTensorSpec.build(spec.mesh, unpartial(spec.placements), gspec.shape, gspec.stride, gspec.dtype,
                                   spec.shard_order)
        local = redistribute_local(grad._local_tensor, gspec, target)
        for j, p in enumerate(spec.placements):
            if p == Partial("avg"):
                local = local / spec.mesh.size(j)
        return local, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, grad_placements):
        ctx.spec = x._spec
        ctx.grad_placements = grad_placements
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec: DTensorSpec = ctx.spec
        # a Partial(sum)'s terms each get the whole gradient: Replicate, never the Partial again
        pl = tuple(p.local_grad() for p in spec.placements) if ctx.grad_placements is None else ctx.grad_placements
        gspec = DTensorSpec.build(spec.mesh, pl, spec.shape, spec.stride, grad.dtype,
                                  spec.shard_order if ctx.grad_placements is None else None)
        return DTensor(grad, gspec), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, target: DTensorSpec, forward_dtype, backward_dtype, async_op=False):
        src = x._spec
        ctx.src = src
        ctx.orig_dtype = x._local_tensor.dtype
        ctx.backward_dtype = backward_dtype
        local = x._local_tensor
        if forward_dtype is not None and forward_dtype != local.dtype:
            local = local.to(forward_dtype)
            src = src.with_dtype(forward_dtype)
        target = interned(DTensorSpec(target.mesh, target.placements, src.shape, src.stride, src.dtype,
                                      target.shard_order))
        if src.placements == target.placements and src.shard_order == target.shard_order and src.mesh == target.mesh:
            return DTensor(local, src, requires_grad=x.requires_grad)
        if comm.listening():
            with comm.scope("redistribute"):
                local = relocate(local, src, target, async_op)
        else:
            local = relocate(local, src, target, async_op)
        return DTensor(local, target, requires_grad=x.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        src: DTensorSpec = ctx.src
        want = ctx.backward_dtype or ctx.orig_dtype
        gspec, local = grad._spec, grad._local_tensor
        if local.dtype != want:
            local = local.to(want)
            gspec = gspec.with_dtype(want)
        target = DTensorSpec.build(src.mesh, unpartial(src.placements), gspec.shape, gspec.stride, want, src.shard_order)
        local = relocate(local, gspec, target)
        if local.dtype != ctx.orig_dtype:
            local = local.to(ctx.orig_dtype)
        out = DTensor(local, target.with_dtype(ctx.orig_dtype), requires_grad=grad.requires_grad)
        return out, None, None, None, None


def _spread_from(t: torch.Tensor, spec: DTensorSpec, src: int, coord: list[int]) -> torch.Tensor:
    """Broadcast the data of coordinate ``(src, ..., src)`` mesh dim by mesh dim, chunking
    after each sharded dim (execution order first, so later broadcasts move smaller pieces).

    A group broadcasts only if its source already holds valid data: every mesh dim not yet
    processed (other than its own) has coordinate ``src`` -- the others would move garbage.
    """
    mesh = spec.mesh
    sharding = [j for _, js in spec.shard_order for j in js]
    todo = sharding + [j for j in range(mesh.ndim) if j not in sharding]
    pending = set(todo)
    for j in todo:
        pending.discard(j)
        if all(coord[k] == src for k in pending):
            t = comm.broadcast(t, src, mesh, j)
        p = spec.placements[j]
        if p.nests == ORDERED:
            t = p.split_value(t, mesh.shape[j], coord[j]).contiguous()
    return t


def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None, *,
                      src_data_rank: int | None = 0) -> DTensor:
    """Shard or replicate a full tensor over the mesh, taking the data of ``src_data_rank``.

    A ``Partial`` placement splits the value into terms that reduce back to it exactly (for
    ``sum``: the value on coordinate 0 and zeros elsewhere; for ``avg``, ``max``, ``min``: the
    value everywhere), so ``full_tensor()`` gives the input bit for bit.  Without
    ``device_mesh``, the mesh of the enclosing ``with mesh:`` block.

    ``src_data_rank=None`` moves no data: every rank takes its piece of its own tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute_tensor needs a torch.Tensor, got {type(tensor).__name__}")
    if isinstance(tensor, DTensor):
        raise TypeError("distribute_tensor got a DTensor; use .redistribute() to change its placements")
    device_mesh = resolve_mesh(device_mesh, "distribute_tensor")
    if placements is None:
        placements = [Replicate()] * device_mesh.ndim
    spec = DTensorSpec.build(device_mesh, placements, tensor.shape, tensor.stride(), tensor.dtype)
    if src_data_rank is not None and (not isinstance(src_data_rank, int) or isinstance(src_data_rank, bool)):
        raise TypeError(f"distribute_tensor: src_data_rank must be an int mesh coordinate or None, got {src_data_rank!r}")
    if src_data_rank is not None and not 0 <= src_data_rank < min(device_mesh.shape):
        raise ValueError(f"src_data_rank={src_data_rank} must be a coordinate in 0..{min(device_mesh.shape) - 1} "
                         f"on every dim of mesh shape {device_mesh.shape} (or None for no communication)")
    coord = device_mesh.get_coordinate()
    if coord is None:
        local = empty_local(spec, tensor.device)
    else:  # each placement splits the value (Partial: terms that reduce back to it exactly)
        local = tensor.detach()
        if src_data_rank is None:
            local = split_local(local, device_mesh.shape, coord, spec.placements, spec.shard_order)
        else:
            local = split_local(_spread_from(local.contiguous(), spec, src_data_rank, coord), device_mesh.shape,
                                coord, spec.placements, spec.shard_order, ordered=False)
        local = local.clone(memory_format=torch.contiguous_format)
    return DTensor(local, spec, requires_grad=tensor.requires_grad)


TORCH_FUNCTION_CODES.add(DTensor.__dict__["__torch_function__"].__func__.__code__)  # see implicit.built_by_torch
draws_itself(DTensor)  # a random op on a DTensor draws through its rule (rng.draw), not the rank's mode
