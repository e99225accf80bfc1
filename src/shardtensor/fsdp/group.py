"""The parameters of one ``fully_shard`` module: one all-gather in, one reduce-scatter out.

``ParamGroup.unshard()`` returns an ``Unsharded`` handle holding the padded unsharded
buffers of one forward call.  Copy-in concatenates the padded local shards into one flat
buffer (casting copies under a param dtype), one all-gather over the dp mesh dim returns a
``(W, M)`` stack, and ``split_with_sizes_copy`` scatters it into the per-parameter buffers.
The handle's storage can be freed (``untyped_storage().resize_(0)``) and refilled in place
before backward without touching the autograd version counters of the tensors the forward
saved; a freed handle no forward call holds is reused by the next one, so a step allocates
no handles.  On a dp dim of one rank without a cast the padded shards are the unsharded
parameters: the handle's buffers are the shards themselves, so nothing is copied or freed.
(Backward then computes with the parameters' values at backward time, as it does on every
module that reshards after forward, here and in torch's FSDP2.)

``_Unshard`` is the autograd edge: sharded parameters in, unsharded views out; its backward
packs the unsharded gradients with ``chunk_cat`` (cast to the reduce dtype inside the copy),
runs one reduce-scatter (average over dp; on HSDP then one all-reduce over the replicas) and
returns the sharded gradients as DTensors with the sharded parameters' specs, so autograd
accumulates them into ``param.grad``.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Sequence, cast

import torch

from .. import comm
from ..placement import Partial, display
from ..redistribute import redistribute_local
from ..spec import DTensorSpec, contiguous_stride
from ..tensor import DTensor
from .packing import Packing
from .param import FSDPParam, MeshInfo

__all__ = ["ParamGroup", "Unsharded"]


class Unsharded:
    """The unsharded buffers of one forward call: views into one byte storage per device, so a
    free or a refill is one storage resize, whatever the number of parameters."""

    def __init__(self, group: "ParamGroup") -> None:
        self.group = group
        lay = group.layout()
        if lay.aliased:  # the padded shards are the unsharded parameters: nothing to gather or free
            self.buffers = [p.padded for p in group.params]
            self.storages, self.nbytes, self.targets = [], [], []
        else:
            flats = {dev: torch.empty(n, dtype=torch.uint8, device=dev) for dev, n in lay.storage_bytes.items()}
            raws = {dev: f.data for dev, f in flats.items()}  # own version counters: refills are invisible to autograd
            self.buffers = [_carve(flats, spot) for spot in lay.spots]
            self.storages = [r.untyped_storage() for r in raws.values()]
            self.nbytes = [st.nbytes() for st in self.storages]
            # where copy-out writes: views stay valid across frees and refills
            self.targets = group.gather_targets([_carve(raws, spot) for spot in lay.spots])
        self.views = [p.unsharded_view(b) for p, b in zip(group.params, self.buffers)]
        for st in self.storages:
            st.resize_(0)
        self.freed = True
        self.pending: tuple | None = None

    def gather(self) -> None:
        """(Re)fill the buffers: copy-in, one all-gather over dp, copy-out (finishes a prefetch)."""
        if self.pending is None:
            self.start()
        else:
            self.group.prefetch_hits += 1
        self.group.all_gather_finish(self.pending)
        self.pending = None
        self.freed = False

    def start(self) -> None:
        """Copy-in and issue the all-gather without waiting for it (a prefetch)."""
        if self.pending is not None:
            return
        for st, n in zip(self.storages, self.nbytes):
            if st.nbytes() != n:
                st.resize_(n)
        self.pending = self.group.all_gather_start(self.targets)

    def free(self) -> None:
        if self.pending is not None:
            self.gather()  # a collective in flight completes before its buffers go
        if self.freed:
            return
        for st in self.storages:
            st.resize_(0)
        self.freed = True


class ParamGroup:
    """The FSDP parameters of one module with its mesh and mixed-precision settings."""

    def __init__(self, params: list[FSDPParam], info: MeshInfo, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None) -> None:
        self.params = params
        self.info = info
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.sync = True
        self.divide_factor: float | None = None  # None: the dp size (an average); 1.0: a plain sum
        self.force_sum = False  # reduce with sums and divide locally (no avg collective)
        self.reshard_after_backward = True
        self.kept: Unsharded | None = None  # unsharded after a backward that did not reshard
        self.asked = False  # the prefetch is an unshard(async_op=True) a forward has not used yet
        self.unreduced = False  # unsynchronized backwards left gradients for the next synchronized one
        self.all_reduce = True  # HSDP: False keeps the replicas' reduce-scattered blocks (set_requires_all_reduce)
        self.replica_part: dict[tuple, torch.Tensor] = {}  # per reduce plan: those blocks, summed
        self.prefetched: Unsharded | None = None
        self.prefetch_hits = 0  # gathers that found their all-gather already issued (a prefetch)
        self.live: weakref.WeakSet[Unsharded] = weakref.WeakSet()
        self._layout: _Layout | None = None
        self._spare: Unsharded | None = None
        self._reduce_plans: dict[tuple, _ReducePlan] = {}  # by (parameter indices, their gradients' dtypes)
        self.traced_key: str | None = None  # traced.gather_group's key (None: compiled code runs the eager hooks)

    def show_sharded(self) -> None:
        """Every owner of each parameter holds the sharded parameter (``hooks.py`` writes the
        same loop inline: dynamo traces that file only)."""
        for p in self.params:
            for mod, name in p.owners:
                mod._parameters[name] = p.sharded

    def show(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every owner of each parameter holds its tensor of ``tensors`` (the unsharded ones a
        forward computes with: plain tensors, on purpose)."""
        for p, t in zip(self.params, tensors):
            for mod, name in p.owners:
                mod._parameters[name] = t  # type: ignore[assignment]

    def compute_dtype(self, p: FSDPParam) -> torch.dtype:
        if self.param_dtype is not None and p.orig_dtype.is_floating_point:
            return self.param_dtype
        return p.orig_dtype

    # -- all-gather ------------------------------------------------------------------------
    def unshard(self) -> Unsharded:
        """The unsharded buffers for one forward call: the prefetched ones, or gathered now."""
        h, self.kept = self.kept, None
        if h is not None and not h.freed:  # kept since the last backward: no gather
            self.drop_prefetch(asked_too=True)
            self.live.add(h)
            return h
        h, self.prefetched = self.prefetched, None
        self.asked = False
        if h is None:
            h = self._idle_handle()
        if h.freed or h.pending is not None:  # (a waited-for prefetch is already gathered)
            h.gather()
        self.live.add(h)
        return h

    def prefetch(self, asked: bool = False) -> None:
        """Start the next forward's all-gather now, so it overlaps the current module's compute
        (``asked``: the user's ``unshard(async_op=True)``, kept until a forward uses it)."""
        if self.prefetched is None and self.kept is None:
            self.prefetched = self._idle_handle()
            self.prefetched.start()
        self.asked = self.asked or asked

    def _idle_handle(self) -> Unsharded:
        """The last handle again when no forward call holds it (it is freed then), else a new one.

        A handle leaves ``live`` once its backward ran, or the forward built no graph, or
        backward ended; an old graph that still holds its views re-gathers before using them, as
        it would if the handle were its own, so the buffers are reused as FSDP2 reuses its
        unsharded parameters: a module called once per step allocates nothing per step."""
        h = self._spare
        if h is None or h in self.live or h.pending is not None or not h.freed:
            h = self._spare = Unsharded(self)
        return h

    def drop_prefetch(self, asked_too: bool = False) -> None:
        """Forget a prefetch the forward never used (its data may be stale by the next one); one
        the user asked for stays until a forward uses it or a backward ends (``asked_too``)."""
        if self.prefetched is not None and (asked_too or not self.asked):
            self.prefetched.free()
            self.prefetched = None
            self.asked = False

    def adopt_locals(self) -> None:
        """After ``nn.Module._apply``: shards follow their parameters' new device or dtype, and
        what was built for the old ones (layout, buffers, plans) is built again when next needed."""
        if any([p.adopt_local() for p in self.params]):
            self.prefetched = self._spare = self._layout = None
            self.live = weakref.WeakSet()
            self._reduce_plans.clear()

    def layout(self) -> "_Layout":
        """What the all-gather packs, worked out once: the parameters with elements, their sizes and
        how their shards travel (one dtype as is, one dtype after a cast, or mixed dtypes as bytes)."""
        if self._layout is None:
            self._layout = _Layout(self)
        return self._layout

    def all_gather_start(self, targets: Sequence[torch.Tensor]) -> tuple | None:
        """Copy-in and the all-gather issued asynchronously; ``all_gather_finish`` completes it by
        splitting the stack into ``targets`` (``gather_targets`` of a handle's buffers)."""
        lay = self.layout()
        if not lay.items:
            return None
        params = self.params
        # no autograd context needed here or in the finish: the padded shards and the buffers
        # never require grad, so nothing is recorded
        for i in lay.items:
            params[i].sync_padded()
        if lay.aliased:
            return None
        if lay.mode == "same":  # one concatenation of the padded shards (and a ragged rank's zeros)
            flat = torch.cat(lay.padded_sources)
        elif lay.mode == "cast":  # cast inside the copies
            flat = torch.empty(lay.total, dtype=lay.dtype, device=lay.sources[0].device)
            short = lay.short
            torch._foreach_copy_(list(flat.narrow(0, 0, lay.total - short).split(lay.sizes)), lay.sources)
            if short:
                flat.narrow(0, lay.total - short, short).zero_()
        else:  # mixed dtypes travel as bytes
            flat = torch.cat([params[i].padded.to(self.compute_dtype(params[i])).reshape(-1).view(torch.uint8)
                              for i in lay.items] + lay.pad)
        if self.info.world == 1:  # one rank: the stack is its packed shards (no collective, no copy)
            return comm.Completed(flat.unsqueeze(0)), lay, targets
        return comm.all_gather(flat, self.info.mesh, self.info.dp_dim, async_op=True), lay, targets

    def gather_targets(self, raw: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Where the all-gather's ``(W, total)`` stack is split into: each gathered parameter's
        unsharded buffer as ``(W, its share)``, or flat for a ragged one (bytes when dtypes are mixed)."""
        lay, W = self.layout(), self.info.world
        out = []
        for i, n in zip(lay.items, lay.sizes):
            t = raw[i].view(-1).view(torch.uint8) if lay.mode == "bytes" else raw[i].view(-1)
            out.append(t if self.params[i].ragged else t.view(W, n))
        return out

    @staticmethod
    def all_gather_finish(pending: tuple | None) -> None:
        """Wait for the all-gather and copy-out into the unsharded buffers."""
        if pending is None:
            return
        work, lay, dst = pending
        stack = work.wait()
        lay.copy_out(stack, dst)

    # -- reduce-scatter --------------------------------------------------------------------
    def reduce_grads(self, idx: tuple[int, ...], grads: Sequence[torch.Tensor | None]) -> list[DTensor | None]:
        """Sharded gradients (average over dp) of the unsharded ``grads`` of the parameters at
        ``idx`` (``None`` stays ``None``).

        Without gradient sync (``set_requires_gradient_sync(False)``) the unsharded local
        gradients are added to each parameter's ``accumulated`` buffer and nothing is returned;
        the next synchronized backward reduces them together with its own.
        """
        params = [self.params[i] for i in idx]
        local = [None if g is None else self._local_grad(p, g) for p, g in zip(params, grads)]
        if not self.sync:
            for p, g in zip(params, local):
                if g is not None:
                    dtype = self.reduce_dtype or g.dtype
                    p.accumulated = g.to(dtype, copy=True) if p.accumulated is None else p.accumulated.add_(g)
                    self.unreduced = True
            return [None] * len(params)
        for i, p in enumerate(params):
            if p.accumulated is not None:
                mine = local[i]
                local[i] = p.accumulated if mine is None else p.accumulated.add_(mine)
                p.accumulated = None
        self.unreduced = any(p.accumulated is not None for p in self.params)
        dtypes = tuple([None if g is None else g.dtype for g in local])
        plan = self._reduce_plans.get((idx, dtypes))
        if plan is None:
            plan = self._reduce_plans[idx, dtypes] = _ReducePlan(params, dtypes, self.reduce_dtype, self.info.world,
                                                                 self.info.rank)
        out: list[DTensor | None] = [None] * len(params)
        for i in plan.empty:
            p = params[i]
            out[i] = p.wrap_grad(torch.zeros((p.rows, *p.rest), dtype=p.orig_dtype, device=p.padded.device))
        if not plan.pieces:
            return out
        rdtype = plan.dtype
        got = cast("list[torch.Tensor]", [local[i] for i in plan.todo])  # the plan's todo have gradients
        grads_in = [g.to(rdtype) if c else g for g, c in zip(got, plan.casts)]
        flat = torch.empty((self.info.world, plan.numel), dtype=rdtype, device=grads_in[0].device)
        with torch.no_grad():
            plan.pack(grads_in, flat)
            red = self._average(flat, (idx, dtypes))
        if red is None:  # HSDP without the all-reduce: the block waits in replica_part, no gradient yet
            return [None] * len(params)
        red = red.contiguous()
        base = red.storage_offset()
        for i, shape, stride, at, recast in plan.pieces:
            piece = red.as_strided(shape, stride, base + at)
            out[i] = params[i].wrap_grad(piece.to(params[i].orig_dtype) if recast else piece)
        return out

    def _average(self, flat: torch.Tensor, key: tuple) -> torch.Tensor | None:
        """This rank's block of the ``(W, n)`` gradients reduced over dp (reduce-scatter) and, on
        HSDP, over the replicas (all-reduce), divided by the dp size (or by the module's
        ``set_gradient_divide_factor``); integer and low-precision sums are divided in two steps
        to keep them in range.  HSDP with ``all_reduce`` off: the reduce-scattered block is added
        to the ones kept for plan ``key`` and None returned; the next all-reduce takes their sum
        (as FSDP2's ``set_requires_all_reduce(False)``)."""
        info = self.info
        n = info.world * info.replicas
        factor = n if self.divide_factor is None else self.divide_factor
        if info.world == 1 and info.rep_dim is None:  # one rank: its block is the result (no copy)
            return flat[0] if factor == 1 else flat[0] / factor
        avg = factor == n and not self.force_sum and flat.dtype in (torch.float32, torch.bfloat16, torch.float64)
        pre, post = (1.0, 1.0) if avg else _divide_factors(n) if factor == n else (1.0, factor)
        if pre != 1:
            flat.div_(pre)
        red = comm.reduce_scatter(flat, "avg" if avg else "sum", info.mesh, info.dp_dim)
        if info.rep_dim is not None:
            kept = self.replica_part.pop(key, None)
            if kept is not None:
                red = kept.add_(red)
            if not self.all_reduce:
                self.replica_part[key] = red
                return None
            red = comm.all_reduce(red, "avg" if avg else "sum", info.mesh, info.rep_dim)
        return red if post == 1 else red.div_(post)

    @staticmethod
    def _local_grad(p: FSDPParam, g: torch.Tensor) -> torch.Tensor:
        """The gradient as the unsharded local tensor (TP: moved to the parameter's placements)."""
        if p.tp_spec is None:
            if isinstance(g, DTensor):
                raise TypeError(f"FSDP: the gradient of the plain parameter {p.fqn} is a DTensor "
                                f"({g.placements}); the forward mixed it with DTensors")
            return g
        if not isinstance(g, DTensor) or g.device_mesh != p.tp_spec.mesh:
            raise TypeError(f"FSDP: the gradient of the TP parameter {p.fqn} is not a DTensor on {p.tp_spec.mesh}")
        if g._spec.placements == p.tp_spec.placements and g._spec.is_default_order:
            return g._local_tensor
        # on the data-parallel dims each rank's local gradient is its own term, Replicate or
        # Partial(sum) alike (as FSDP2): the reduce-scatter below combines them
        dp_dims = p.info.dp_dims if p.tp_spec.mesh == p.info.mesh else ()
        want = list(p.tp_spec.placements)
        for d in dp_dims:
            if not (g.placements[d].is_replicate() or g.placements[d] == Partial("sum")):
                raise NotImplementedError(
                    f"FSDP: the gradient of {p.fqn} is {display(g.placements)}; on the data-parallel mesh dim {d} it "
                    "must be Replicate or Partial(sum) (each rank's own term), FSDP combines them itself")
            want[d] = g.placements[d]
        target = DTensorSpec.build(g._spec.mesh, want, g.shape, g.stride(), g.dtype)
        return redistribute_local(g._local_tensor, g._spec, target)


class _Layout(Packing):
    """How a group's shards travel in its all-gather (``ParamGroup.layout``)."""

    def __init__(self, group: ParamGroup) -> None:
        params, info = group.params, group.info
        items = [i for i, p in enumerate(params) if p.numel > 0]
        dtypes = {group.compute_dtype(params[i]) for i in items}
        self.dtype = next(iter(dtypes)) if len(dtypes) == 1 else torch.uint8
        if len(dtypes) > 1:
            self.mode = "bytes"
            super().__init__(params, items, lambda i: group.compute_dtype(params[i]).itemsize, info.world, info.rank)
        else:
            self.mode = "same" if all(params[i].padded.dtype == self.dtype for i in items) else "cast"
            super().__init__(params, items, lambda i: 1, info.world, info.rank)
        # one dp rank and no cast: the unsharded parameters are views of the padded shards
        self.aliased = info.world == 1 and self.mode == "same"
        self.sources = [params[i].padded.view(-1) for i in self.items]  # ``padded`` is never replaced
        self.short = self.total - sum(self.sizes)  # a ragged rank's block ends early: zeros up to the longest
        self.pad = [params[self.items[-1]].padded.new_zeros(self.short, dtype=self.dtype)] if self.short else []
        self.padded_sources = self.sources + self.pad
        # where each unsharded buffer lives: (device, byte offset, dtype, shape), offsets aligned
        self.storage_bytes: dict[torch.device, int] = {}
        self.spots: list[tuple[torch.device, int, torch.dtype, tuple[int, ...]]] = []
        for p in params:
            dev, dtype = p.padded.device, group.compute_dtype(p)
            shape = p.buffer_shape
            at = self.storage_bytes.get(dev, 0)
            self.spots.append((dev, at, dtype, shape))
            self.storage_bytes[dev] = at + -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN


class _ReducePlan(Packing):
    """How one backward's gradients are packed and handed back, worked out once per group, set of
    trainable parameters and pattern of gradient dtypes (``None``: no gradient): the same every step.

    The pack's dtype is the reduce dtype, else the promotion of the gradients' dtypes.  A
    gradient is cast before packing unless it is already that dtype or a narrower float (the
    pack's copy widens it), and every one is cast when dtypes would still be mixed.  ``pieces``
    are ``(param index, shape, stride, offset in the reduced block, cast to the param's dtype)``.
    """

    def __init__(self, params: Sequence[FSDPParam], dtypes: tuple, reduce_dtype: torch.dtype | None, world: int,
                 rank: int) -> None:
        got = [i for i, d in enumerate(dtypes) if d is not None]
        self.empty = [i for i in got if params[i].numel == 0]
        super().__init__(params, [i for i in got if params[i].numel > 0], lambda i: 1, world, rank)
        self.todo = self.items
        self.dtype = reduce_dtype or functools.reduce(torch.promote_types, [dtypes[i] for i in self.todo],
                                                      dtypes[self.todo[0]] if self.todo else torch.float32)
        self.casts = [not (dtypes[i] == self.dtype or _widens(dtypes[i], self.dtype)) for i in self.todo]
        if len({self.dtype if c else dtypes[i] for i, c in zip(self.todo, self.casts)}) > 1:
            self.casts = [dtypes[i] != self.dtype for i in self.todo]
        self.pieces: list[tuple[int, tuple[int, ...], tuple[int, ...], int, bool]] = []
        for i, at in zip(self.todo, self.starts):
            p = params[i]
            shape = (p.rows, *p.rest)
            self.pieces.append((i, shape, contiguous_stride(shape), at, p.orig_dtype != self.dtype))
        self.numel = self.total


_ALIGN = 64  # bytes: every buffer starts where any dtype (and vector loads) may


def _carve(flats: dict[torch.device, torch.Tensor], spot: tuple) -> torch.Tensor:
    """The buffer at ``spot`` (device, byte offset, dtype, shape) of the byte storages ``flats``."""
    dev, at, dtype, shape = spot
    n = math.prod(shape) * dtype.itemsize
    return flats[dev].narrow(0, at, n).view(dtype).view(shape)


def _widens(src: torch.dtype, dst: torch.dtype) -> bool:
    return src.is_floating_point and dst.is_floating_point and torch.finfo(dst).bits > torch.finfo(src).bits


def _divide_factors(n: int) -> tuple[float, float]:
    """Pre/post divide factors for sum-reductions in low precision."""
    f = 1
    while n % f == 0 and n / f > f:
        f *= 2
    return float(f), n / f


class _Unshard(torch.autograd.Function):
    """Sharded parameters -> unsharded views; backward: chunk_cat + one reduce-scatter."""

    @staticmethod
    def forward(ctx, handle: Unsharded, idx: tuple[int, ...], *sharded: torch.Tensor):
        ctx.handle = handle
        ctx.idx = idx
        ctx.set_materialize_grads(False)
        params, buffers = handle.group.params, handle.buffers
        return tuple([params[i].unsharded_view(buffers[i]) for i in idx])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        handle: Unsharded = ctx.handle
        group = handle.group
        out = group.reduce_grads(ctx.idx, grads)
        if group.reshard_after_backward:
            handle.free()
        else:  # the next forward uses them as they are (FSDP2's set_reshard_after_backward(False))
            group.kept = handle
        group.live.discard(handle)
        return (None, None, *out)


_requires_grad = torch._C.TensorBase.requires_grad.__get__  # type: ignore[attr-defined]


def unsharded_with_grad(handle: Unsharded) -> list[torch.Tensor]:
    """The tensors the forward uses: trainable ones through ``_Unshard`` (when grad is enabled)."""
    params = handle.group.params
    views = list(handle.views)
    with torch._C.DisableTorchFunctionSubclass():  # torch's own getter, not DTensor's property
        idx = tuple([i for i, p in enumerate(params) if p.requires_grad and _requires_grad(p.sharded)])
    if idx and torch.is_grad_enabled():
        outs = _Unshard.apply(handle, idx, *[params[i].sharded for i in idx])
        for i, o in zip(idx, outs):
            views[i] = o
    return views
