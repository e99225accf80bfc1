"""``fully_shard`` and ``MixedPrecisionPolicy`` (mirror ``torch.distributed.fsdp``'s FSDP2 API)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..comm import current_transport
from ..mesh import DeviceMesh, init_device_mesh
from .group import ParamGroup, Unsharded, unsharded_with_grad
from .hooks import PostForward, PreForward, cast_floats
from .param import DataParallelMeshDims, FSDPParam, MeshInfo
from .traced import gather_group, traced_key

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "UnshardHandle", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the all-gather/compute (``param_dtype``) and of the reduce-scatter (``reduce_dtype``).

    ``None`` keeps the parameter dtype; ``reduce_dtype=None`` with a ``param_dtype`` reduces in
    the param dtype (as FSDP2).  Sharded parameters and their gradients keep the original
    dtype.  ``output_dtype`` casts floating outputs; ``cast_forward_inputs`` casts floating
    inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (FSDP2's default policy)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, gradients and optimizer states on the CPU (FSDP2's policy)."""

    pin_memory: bool = True


class FSDPState:
    """Per-module FSDP state: the parameter group, hooks' settings and the live forward handle."""

    def __init__(self, modules: list[nn.Module], group: ParamGroup, reshard_after_forward: bool,
                 mp: MixedPrecisionPolicy) -> None:
        self.modules = modules  # several for fully_shard([a, b]): one group, gathered once per forward
        self._to_run: set[int] = set()  # modules of the list this forward has not run yet
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.mp = mp
        self.is_root: bool | None = None
        self.nested = False  # under another fully_shard module (a root never reshards after forward)
        self.handle: Unsharded | None = None
        self.unsharded: list[torch.Tensor] = []  # what the latest forward computed with
        self._graph_built = False
        self._callback_queued = False
        self.root: FSDPState = self
        self.tree: list[FSDPState] = []  # root only: every state under it, found at the first forward
        self.order: list[FSDPState] | None = None  # root only: pre-forward order of the first forward
        self.post_order: list[FSDPState] = []  # root only: its post-forward order (reversed: backward's)
        self.recording = False
        self.forward_prefetch: list[FSDPState] | None = None  # None: the next state in forward order
        self.backward_prefetch: list[FSDPState] | None = None  # None: the next one in backward
        self.in_method = 0  # inside a method registered by register_fsdp_forward_method

    def states_in_tree(self) -> list["FSDPState"]:
        found = {id(m._fsdp_state): m._fsdp_state for top in self.modules for m in top.modules()
                 if isinstance(m, FSDPModule)}
        return list(found.values())

    # -- hooks ----------------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.in_method:  # a forward inside a registered method: the method's gather serves
            return args, kwargs
        if self._to_run:  # a later module of the group: the group's gather of this round serves
            self._to_run.discard(id(module))
            assert self.handle is not None
            self._show_unsharded(self.handle, self.unsharded)
        else:
            self._gather(module)
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = cast_floats((args, kwargs), self.mp.param_dtype)
        return args, kwargs

    def _gather(self, module: nn.Module) -> None:
        """The first module of a round: root bookkeeping, this group's all-gather (and the
        next one's prefetch), and the owners get the unsharded tensors."""
        if len(self.modules) > 1:
            self._to_run = {id(m) for m in self.modules if m is not module}
        if self.is_root is None:
            self.tree = self.states_in_tree()  # fixed from the first forward on, as in FSDP2
            for s in self.tree:
                if s.is_root is None:
                    s.is_root = False
                    s.root = self
            self.is_root = True
        if self.is_root:
            self._callback_queued = False
            self._begin_forward()
        if self.root.recording:
            self.root.order.append(self)  # type: ignore[union-attr]
        handle = self.group.unshard()
        self.handle = handle
        for s in self._prefetch_targets(forward=True):
            s.group.prefetch()
        tensors = self.unsharded = unsharded_with_grad(handle)
        self._graph_built = any(t.requires_grad for t in tensors)
        self.group.show(tensors)

    def _show_unsharded(self, handle: Unsharded, tensors: list[torch.Tensor]) -> None:
        """The owners hold a forward's unsharded ``tensors`` again, gathered again if they were
        freed: before a module's backward (a checkpoint wrapper under ``fully_shard`` recomputes
        its inner forward then, which no forward hook precedes), and for a later module of a
        list (a backward in between, as in a chunked loss calling one of them per chunk, gave
        the owners their shards back)."""
        if handle.freed:
            handle.gather()
            self.group.live.add(handle)
        self.group.show(tensors)

    # -- prefetch: the next all-gather overlaps this module's compute ---------------------
    def _begin_forward(self) -> None:
        """Root, at each forward: record the order once; drop prefetches a forward left unused;
        a list's round of modules starts again."""
        if self.order is None:
            self.order, self.post_order, self.recording = [], [], True
        for s in self.tree:
            s.group.drop_prefetch()
            s._to_run.clear()

    def _prefetch_targets(self, forward: bool) -> list["FSDPState"]:
        explicit = self.forward_prefetch if forward else self.backward_prefetch
        if explicit is not None:
            return explicit
        order = self.root.order if forward else self.root.post_order
        if self.root.recording or not order or self not in order:
            return []
        i = order.index(self) + (1 if forward else -1)  # backward runs in reverse post-forward order
        return [order[i]] if 0 <= i < len(order) else []

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.in_method:
            return output
        if self._to_run:  # the group's other modules have yet to run: keep the parameters unsharded
            if self._graph_built and torch.is_grad_enabled():
                self._hook_outputs(output)
        else:
            self._reshard(output)
        if self.mp.output_dtype is not None:
            output = cast_floats(output, self.mp.output_dtype)
        return output

    def _reshard(self, output: Any) -> None:
        """The last module of a round: the owners get the shards back; the unsharded buffers are
        freed unless backward will use them (the root keeps them, and so does any module
        without ``reshard_after_forward``)."""
        if self.root.recording:
            self.root.post_order.append(self)
            if self.is_root:
                self.recording = False  # the order is known after the first forward
        self.group.show_sharded()
        handle = self.handle
        assert handle is not None
        if not self._graph_built or not torch.is_grad_enabled():
            handle.free()
            self.group.live.discard(handle)
        else:
            if self.reshard_after_forward and not self.is_root:
                handle.free()
            self._hook_outputs(output)

    def _hook_outputs(self, output: Any) -> None:
        """Backward through ``output`` first gathers the parameters again if they were freed."""
        assert self.handle is not None
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._pre_backward_hook(self.handle))

    def _pre_backward_hook(self, handle: Unsharded):
        tensors = self.unsharded

        def hook(grad: torch.Tensor) -> None:
            self._show_unsharded(handle, tensors)
            for s in self._prefetch_targets(forward=False):
                if s.handle is not None and s.handle.freed:
                    s.handle.start()
            root = self.root  # (any module's backward queues it: a root may have no parameters)
            if not root._callback_queued:
                root._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(root._finalize_backward)
        return hook

    def _finalize_backward(self) -> None:
        """End of backward (root): free unsharded buffers whose gradients never came, and give
        every module its sharded parameters back.  Activation checkpointing (non-reentrant)
        recomputes a module's forward inside backward and stops it once the saved tensors are
        back, before the forward hook: the module would keep its unsharded tensors as parameters
        (without gradients, so ``model.parameters()`` missed every gradient)."""
        self._callback_queued = False
        for s in self.tree:
            for h in list(s.group.live):
                h.free()
            s.group.live.clear()
            s.group.drop_prefetch(asked_too=True)  # an optimizer step may change the shards next
            s.group.show_sharded()


class FSDPModule:
    """Mixin added to every ``fully_shard`` module's class (``FSDP<Name>``), as in FSDP2."""

    _fsdp_state: FSDPState

    def reshard(self) -> None:
        """Free the unsharded parameters of this module (they are re-gathered when needed)."""
        group = self._fsdp_state.group
        for h in [*group.live, *([group.kept] if group.kept is not None else [])]:
            h.free()
        group.live.clear()
        group.kept = None

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """All-gather now: the next forward uses the result without gathering.  With
        ``async_op=True`` the all-gather is left in flight and an ``UnshardHandle`` is returned;
        its ``wait()`` (or the module's next forward) completes it."""
        st = self._fsdp_state
        st.group.prefetch(asked=True)  # the next forward's gather, issued now
        handle = UnshardHandle(st.group)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        for m in self._fsdp_modules(recurse):
            m._fsdp_state.reshard_after_forward = bool(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """With ``False`` the unsharded parameters stay after backward and the next forward uses
        them without an all-gather (gradient accumulation: memory for communication).  Set it
        back to ``True`` before the optimizer step changes the sharded parameters."""
        for m in self._fsdp_modules(recurse):
            m._fsdp_state.group.reshard_after_backward = bool(reshard_after_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the dp size (``1.0``:
        the plain sum, for a trainer that scales the loss by the global token count itself)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be a positive number, got {factor!r}")
        self._fsdp_state.group.divide_factor = float(factor)

    set_reduce_scatter_divide_factor = set_gradient_divide_factor  # FSDP2's older name

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with sum collectives only and divide locally (for backends without an average
        or pre-multiplied sum); the result is the same."""
        self._fsdp_state.group.force_sum = bool(enable)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` skips the all-reduce over replicas in backward (gradient accumulation
        with reduce-scatters only): each reduce-scattered block is kept, no ``.grad`` is set,
        and the next backward with ``True`` all-reduces their sum with its own.  Without
        replicas there is no all-reduce: nothing changes."""
        for m in self._fsdp_modules(recurse):
            m._fsdp_state.group.all_reduce = bool(requires_all_reduce)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 code: every reduce-scatter here completes within its backward, so
        nothing waits for the last one."""

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted for FSDP2 code: the all-gathers run on the current stream, after the
        optimizer step's work, so there is no event to wait on."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With ``False``, backward reduces no gradient: each rank adds its unsharded local
        gradients to a buffer (gradient accumulation without communication), and the next
        backward with ``True`` reduce-scatters the sum.  ``param.grad`` changes only then."""
        for m in self._fsdp_modules(recurse):
            m._fsdp_state.group.sync = bool(requires_gradient_sync)

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather ``modules``' parameters right after this module's (default: the next
        module in forward order, as recorded in the first forward)."""
        self._fsdp_state.forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Re-gather ``modules``' parameters when this module's backward starts (default: the
        module whose backward comes next, by the first forward's post-forward order)."""
        self._fsdp_state.backward_prefetch = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``to_empty``, ``to`` and ``cuda`` give the sharded parameters new local tensors (a
        model built on the meta device gets its memory so); the padded shards follow them."""
        out = super()._apply(fn, recurse)  # type: ignore[misc]  # nn.Module's, next in the MRO
        group = self._fsdp_state.group
        group.adopt_locals()
        group.traced_key = traced_key(group)  # devices and dtypes may have changed
        return out

    def _fsdp_modules(self, recurse: bool) -> list["FSDPModule"]:
        if not recurse:
            return [self]
        return [m for m in self.modules() if isinstance(m, FSDPModule)]  # type: ignore[attr-defined]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        return self._fsdp_state.group.info.mesh

    def unsharded_params(self) -> list[torch.Tensor]:
        """The unsharded tensors of the latest forward (their storage is empty once resharded)."""
        h = self._fsdp_state.handle
        return [] if h is None else list(h.views)


class UnshardHandle:
    """``FSDPModule.unshard(async_op=True)``'s handle: ``wait()`` completes the all-gather."""

    def __init__(self, group: ParamGroup) -> None:
        self._group = group

    def wait(self) -> None:
        h = self._group.prefetched
        if h is not None and h.pending is not None:
            h.gather()


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """FSDP2's: ``module.method_name`` (a method other than ``forward``, e.g. ``generate``)
    gathers the parameters before it runs and reshards after, as ``forward`` does; forwards it
    calls inside use that gather.  A module ``fully_shard`` was not applied to is left as it is."""
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    state = module._fsdp_state

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if state.in_method:
            return method(*args, **kwargs)
        args, kwargs = state.pre_forward(module, args, kwargs)
        state.in_method += 1
        try:
            out = method(*args, **kwargs)
        finally:
            state.in_method -= 1
        return state.post_forward(module, args, kwargs, out)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """FSDP2's: let several roots (pipeline stages) share CUDA streams for their collectives.
    This FSDP issues its collectives on the current stream (no streams of its own), so there is
    nothing to share; the modules are checked as FSDP2 checks them."""
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"share_comm_ctx: expects a list of FSDP modules, got {type(m).__name__}")


def _state_of(m: Any, who: str) -> FSDPState:
    if not isinstance(m, FSDPModule):
        raise TypeError(f"{who}: expected modules that fully_shard was applied to, got {type(m).__name__}")
    return m._fsdp_state


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    new = _CLASSES.get(cls)
    if new is None:
        new = _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return new


def managed_params(modules: list[nn.Module]) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Parameters of ``modules`` not under a child ``fully_shard``, each with every (owner, name)."""
    found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}

    def visit(m: nn.Module) -> None:
        for name, p in m._parameters.items():
            if p is not None:
                found.setdefault(id(p), (p, []))[1].append((m, name))
        for child in m.children():
            if not isinstance(child, FSDPModule):
                visit(child)

    for module in modules:
        visit(module)
    children = {q.orig_id: q for top in modules for m in top.modules() if isinstance(m, FSDPModule) and m is not top
                for q in m._fsdp_state.group.params}
    for k, (_, owners) in found.items():
        if k in children:
            mod, name = owners[0]
            raise NotImplementedError(
                f"fully_shard: parameter {type(mod).__name__}.{name} is shared with the child fully_shard module "
                f"that manages {children[k].fqn}; apply fully_shard to a module containing every user of it")
    return list(found.values())


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | None = True, shard_placement_fn: Any = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), offload_policy: "OffloadPolicy | None" = None,
                ignored_params: set[nn.Parameter] | None = None,
                dp_mesh_dims: DataParallelMeshDims | None = None) -> Any:
    """Shard ``module``'s parameters (those no child ``fully_shard`` manages) along dim 0 over dp.

    Apply bottom-up: blocks first, then the root.  Parameters become ``nn.Parameter(DTensor)``
    with ``Shard(0)`` on the dp mesh dim.  ``mesh``: 1-D for FSDP; 2-D for HSDP (replicate over
    dim 0, shard over dim 1); TP parameters on ``parent["tp"]`` with ``mesh=parent["dp"]`` (torch's
    2-D recipe) keep their TP placement on the parent mesh.
    Each forward all-gathers the module's parameters with one collective; backward reduces
    their gradients with one reduce-scatter (average over dp) into ``param.grad``.
    ``reshard_after_forward`` frees the unsharded parameters after forward (re-gathered
    before the module's backward); the root keeps them until its backward.  Returns
    ``module``, whose class becomes ``FSDP<Class>`` (an ``FSDPModule``).  A list of modules is
    one unit (FSDP2's list form): one group, gathered when the first of them runs and resharded
    after all of them ran.  ``ignored_params`` stay plain, unsharded and unreduced.
    ``offload_policy=CPUOffloadPolicy()`` holds where every parameter is on the CPU already.
    ``shard_placement_fn(param)``: ``None`` or ``Shard(0)``, or ``RaggedShard(0, local_units)`` for
    per-rank pieces of chosen sizes (``layouts.py``: whole parameters, aligned blocks).
    ``dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)``: ``mesh`` is the parameters'
    whole mesh (DTensors ``Replicate`` on the dims named there); FSDP shards over the ``shard``
    dim, and each unsharded parameter is a DTensor on that whole mesh again.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard needs an nn.Module or a list of them, got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise RuntimeError(f"fully_shard was already applied to this {type(m).__name__}")
    if not modules:
        raise ValueError("fully_shard: the list of modules is empty")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    _check_unsupported(modules, reshard_after_forward, shard_placement_fn, offload_policy)
    if mesh is None:
        first = next((p for m in modules for p in m.parameters()), None)
        device_type = first.device.type if first is not None else "cpu"
        mesh = init_device_mesh(device_type, (current_transport().world_size,))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a shardtensor DeviceMesh, got {type(mesh).__name__}")
    info = MeshInfo.of(mesh, dp_mesh_dims)
    ignored = {id(p) for p in ignored_params or ()}
    params = [FSDPParam(p, owners, info, shard_placement_fn(p) if shard_placement_fn is not None else None)
              for p, owners in managed_params(modules) if id(p) not in ignored]
    reduce_dtype = mp_policy.reduce_dtype if mp_policy.reduce_dtype is not None else mp_policy.param_dtype
    group = ParamGroup(params, info, mp_policy.param_dtype, reduce_dtype)
    group.show_sharded()  # only once every parameter is accepted: a refusal leaves the module as it was
    state = FSDPState(modules, group, reshard_after_forward is not False, mp_policy)
    # the FSDP modules below (``module`` is not one yet) are nested: known before the first
    # forward, which compiled code never runs eagerly
    for s in state.states_in_tree():
        s.nested = True
    # compiled code gathers a group per hooked call: a list's group takes the eager hooks
    group.traced_key = traced_key(group) if len(modules) == 1 else None
    for m in modules:
        m._fsdp_state = state  # type: ignore[assignment]
        m.register_forward_pre_hook(PreForward(state, gather_group), prepend=True, with_kwargs=True)
        m.register_forward_hook(PostForward(state), always_call=False, with_kwargs=True)
        m.__class__ = _fsdp_class(type(m))
    return module


def _check_unsupported(modules: list[nn.Module], reshard_after_forward: Any, shard_placement_fn: Any,
                       offload_policy: Any) -> None:
    """Refuse, naming the argument, what this FSDP does not do (rather than do something else)."""
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(f"fully_shard: reshard_after_forward={reshard_after_forward!r} (resharding to a "
                                  "smaller group) is not supported; pass True or False")
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"fully_shard: shard_placement_fn must be a callable (parameter -> placement or None), "
                        f"got {type(shard_placement_fn).__name__}")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    if isinstance(offload_policy, CPUOffloadPolicy):
        on = {p.device.type for m in modules for p in m.parameters()} - {"cpu", "meta"}
        if on:
            raise NotImplementedError(f"fully_shard: offload_policy=CPUOffloadPolicy() with parameters on {sorted(on)} "
                                      "is not supported yet (parameters on the CPU are offloaded already)")
