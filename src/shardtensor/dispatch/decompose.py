"""Decompositions: ops without a rule rewritten into ops that have one, before any error.

Three sources, tried in order for an op that has no rule:

1. ``DECOMPOSITIONS`` -- our own table: ``max.dim`` into
   ``amax`` + ``argmax``, ``var_mean``, generic ``sum``/``squeeze``, ``floor_divide``,
   ``split.Tensor``, ``unbind``, ``split_with_sizes_copy``, ``trace``, ``lift_fresh``, the in-place
   views (``squeeze_``, ``t_``) and ``resize_`` ...
2. ``out=`` overloads: the functional overload, then ``copy_`` into each ``out`` tensor (the
   copy rule redistributes the result to ``out``'s placements).
3. PyTorch's own decompositions: the op's CompositeImplicitAutograd kernel
   (``OpOverload.decompose``), then ``torch._decomp.decomposition_table``.

A decomposition runs on the DTensors themselves, so every op it emits goes through dispatch
(with its own rule, cache entry and redistribution).  This is the dispatch layer: rules only
decide, decompositions run.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import PropagationError
from ..placement import Replicate
from ..propagation.registry import unsupported
from ..propagation.rules.foreach import overloads
from ..spec import DTensorSpec
from .fallback import whole_local, wrap_replicated

aten = torch.ops.aten

__all__ = ["DECOMPOSITIONS", "SELF_BECOMES", "Gathered", "decomposition", "find_decomposition"]

DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {}


class Gathered(tuple):
    """A view decomposition's results that are views of a gathered copy of its input, not of the
    input: dispatch records them as copies (a write into one goes back through the view's scatter)."""


def decomposition(*ops: Any) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn(*args, **kwargs)`` as the decomposition of ``ops``."""

    def deco(fn: Callable) -> Callable:
        for op in ops:
            DECOMPOSITIONS[op] = fn
        return fn

    return deco


def _functional_of(op):
    """The functional overload matching an ``out=`` overload (same inputs, no out args)."""
    schema = op._schema
    ins = [a for a in schema.arguments if not a.is_out]
    packet = getattr(aten, op._schema.name.split("::")[-1], None)
    if packet is None:
        return None, ()
    outs = [a.name for a in schema.arguments if a.is_out]
    for name in packet.overloads():
        cand = getattr(packet, name)
        args = cand._schema.arguments
        if any(a.is_out for a in args) or len(args) != len(ins):
            continue
        if all(a.name == b.name for a, b in zip(args, ins)):
            return cand, outs
    return None, ()


def _out_decomposition(op) -> Callable | None:
    if not any(a.is_out for a in op._schema.arguments):
        return None
    functional, outs = _functional_of(op)
    if functional is None:
        return None

    def run(*args, **kwargs):
        out = [kwargs.pop(n) for n in outs]
        res = functional(*args, **kwargs)
        single = not isinstance(res, (tuple, list))
        for o, r in zip(out, [res] if single else res):
            if tuple(o.shape) != tuple(r.shape):
                raise PropagationError(f"shardtensor: {op}: out= tensor has shape {tuple(o.shape)}, the result "
                                   f"{tuple(r.shape)} (resizing a sharded out tensor is not supported)")
            o.copy_(r)
        return out[0] if single else tuple(out)

    return run


def find_decomposition(op) -> Callable[..., Any] | None:
    """A callable on DTensors that computes ``op`` from ops with rules, or None."""
    fn = DECOMPOSITIONS.get(op)
    if fn is not None:
        return fn
    fn = _out_decomposition(op)
    if fn is not None:
        return fn
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return op.decompose
    if torch.Tag.nondeterministic_seeded in op.tags:
        return None  # torch's decompositions draw plain tensors, per rank: the fallback draws agreed ones
    try:
        from torch._decomp import decomposition_table
    except ImportError:  # pragma: no cover
        return None
    return decomposition_table.get(op)


# -- our own decompositions ----------------------------------------------------------------

@decomposition(aten.sum.default)
def _sum_default(x, *, dtype=None):
    return aten.sum.dim_IntList(x, None, False, dtype=dtype)


def _max_min_dim(largest: bool) -> Callable:
    def run(x, dim, keepdim=False):
        from ..tensor import DTensor

        d = dim % max(x.ndim, 1)
        if isinstance(x, DTensor):
            # both outputs come from one input moved once (argmax needs dim whole anyway)
            pl = _whole_along(x._spec, d)
            if pl != x.placements:
                x = x.redistribute(x.device_mesh, pl)
        vals = (aten.amax if largest else aten.amin)(x, [d], keepdim)
        ranked = x.to(torch.uint8) if x.dtype == torch.bool else x  # argmax has no bool kernel; max.dim has
        idx = (aten.argmax if largest else aten.argmin)(ranked, d, keepdim)
        return vals, idx

    return run


def _whole_along(spec: DTensorSpec, d: int | None) -> tuple:
    """The cheapest placements of ``spec`` with dim ``d`` whole on every rank (any dim where ``d``
    is None) and no Partial: each mesh dim that shards ``d`` or holds a Partial either
    replicates, or (cheaper: an all-to-all or a reduce-scatter instead of a gather or an
    all-reduce) shards another dim."""
    from ..propagation.rules.reduction import choices
    from ..propagation.strategy import input_cost

    pls = choices(spec, (), decomposable=True, keep=lambda p: False) if d is None else \
        choices(spec, (d,), decomposable=False, keep=lambda p: False)
    return min(pls, key=lambda pl: input_cost(spec, pl))


@decomposition(aten.linalg_cross.default)
def _linalg_cross(self: Any, other: Any, dim: int = -1) -> Any:
    """torch's decomposition (two ``index_select`` s of each operand along ``dim``) on operands
    made whole along ``dim`` once, the cheapest way (``_whole_along``), not gathered per select."""
    from torch._decomp import decomposition_table

    from ..tensor import DTensor

    nd = max(getattr(self, "ndim", 0), getattr(other, "ndim", 0))
    moved = []
    for t in (self, other):
        if isinstance(t, DTensor) and nd:
            d = dim % nd - (nd - t.ndim)
            if d >= 0:
                pl = _whole_along(t._spec, d)
                t = t.redistribute(t.device_mesh, pl) if pl != t.placements else t
        moved.append(t)
    return decomposition_table[aten.linalg_cross.default](moved[0], moved[1], dim)


def _unpartial(t: Any) -> Any:
    """``t`` with its Partials reduced the cheapest way (to a shard where another mesh dim shards)."""
    from ..tensor import DTensor

    if not isinstance(t, DTensor) or not any(q.is_partial() for q in t.placements):
        return t
    return t.redistribute(t.device_mesh, _whole_along(t._spec, None))


@decomposition(aten.dist.default)
def _dist(self: Any, other: Any, p: Any = 2) -> Any:
    """``vector_norm(self - other, p)`` with a Partial operand that broadcasting enlarges reduced
    first, at its own size: the norm would otherwise reduce the broadcast difference (a Partial
    vector against a replicated batch: 20x the bytes)."""
    n = torch.broadcast_shapes(self.shape, other.shape).numel()
    a, b = (_unpartial(t) if t.numel() < n else t for t in (self, other))
    return torch.linalg.vector_norm(a - b, p)


def _self_reduced_first(op: Any) -> Callable[..., Any]:
    """torch's decomposition of ``op`` with a Partial ``self`` reduced once, first: it feeds
    separate non-linear branches (``log(x)`` and ``log1p(-x)``; ``minimum(0, x)`` beside a
    Partial ``zeros_like(x)``), each of which would reduce its own copy."""
    from torch._decomp import decomposition_table

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        return decomposition_table[op](_unpartial(self), *args, **kwargs)

    return run


for _op in (aten.binary_cross_entropy.default, aten.binary_cross_entropy_with_logits.default):
    DECOMPOSITIONS[_op] = _self_reduced_first(_op)


DECOMPOSITIONS[aten.max.dim] = _max_min_dim(True)
DECOMPOSITIONS[aten.min.dim] = _max_min_dim(False)


@decomposition(aten.var_mean.correction)
def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    return (aten.var.correction(x, dim, correction=correction, keepdim=keepdim),
            aten.mean.dim(x, dim, keepdim) if dim is not None else _mean_all(x, keepdim))


def _mean_all(x, keepdim):
    return aten.mean.dim(x, list(range(x.ndim)), keepdim)


@decomposition(aten.std_mean.correction)
def _std_mean(x, dim=None, *, correction=None, keepdim=False):
    return (aten.std.correction(x, dim, correction=correction, keepdim=keepdim),
            aten.mean.dim(x, dim, keepdim) if dim is not None else _mean_all(x, keepdim))


@decomposition(aten.squeeze.default)
def _squeeze_default(x):
    return aten.squeeze.dims(x, [d for d in range(x.ndim) if x.shape[d] == 1])


@decomposition(aten.squeeze.dim)
def _squeeze_dim(x, dim):
    return aten.squeeze.dims(x, [dim])


def _inplace_view(op) -> Callable:
    """``squeeze_``/``unsqueeze_``/``transpose_``/``t_``/``swapdims_``: the out-of-place view (a
    local view, by its rule), then ``x`` takes its local tensor and spec, and the wrapper its
    sizes and strides (set below the Python dispatch key, so nothing re-enters here)."""
    packet = getattr(aten, op._schema.name.split("::")[-1][:-1])
    overload = op._overloadname if op._overloadname in packet.overloads() else packet.overloads()[0]
    functional = getattr(packet, overload)  # transpose_.default -> transpose.int

    def run(x, *args, **kwargs):
        out = functional(x, *args, **kwargs)
        x._local_tensor, x._spec = out._local_tensor, out._spec
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
            aten.as_strided_.default(x, out.shape, out.stride())
        return x

    return run


for _op in (aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims, aten.unsqueeze_.default,
            aten.transpose_.default, aten.t_.default, aten.swapdims_.default, aten.swapaxes_.default):
    DECOMPOSITIONS[_op] = _inplace_view(_op)


def _resize_wrapper(x, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
    """Give the DTensor wrapper new sizes and strides, below the Python key.  Where its (empty)
    storage is too small, a CPU wrapper's storage is resized on meta kernels (which allocates
    nothing); elsewhere torch has no way to do that, so a growing resize raises."""
    need = (sum((n - 1) * st for n, st in zip(shape, stride)) + 1) * x.element_size() if all(shape) else 0
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
        if need > x.untyped_storage().nbytes():
            if x.device.type != "cpu":
                raise unsupported(aten.resize_.default, [x._spec], f"growing a DTensor on {x.device.type}: "
                                                                   "build a new DTensor of the new shape instead")
            before = torch._C._meta_in_tls_dispatch_include()
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                aten.resize_.default(x, shape)
            finally:
                torch._C._set_meta_in_tls_dispatch_include(before)
        aten.as_strided_.default(x, shape, stride)


def _resize(x, size, memory_format=None):
    """``resize_`` keeps the storage's first elements in row-major order: on the whole tensor,
    replicated, every rank does what one device does.  A sharded self is gathered first
    (``_gathered``).  Every refusal comes before any change."""
    spec = x._spec
    whole = _gathered(x)
    meta = torch.empty(0, dtype=x.dtype, device="meta").resize_(size, memory_format=memory_format)
    _resize_wrapper(x, tuple(meta.shape), meta.stride())
    local = x._local_tensor if whole == spec else whole_local(x)  # contiguous, as x is
    local = local.resize_(size, memory_format=memory_format)
    x._local_tensor = local
    x._spec = DTensorSpec.build(spec.mesh, whole.placements, local.shape, local.stride(), local.dtype)
    return x


def _gathered(x) -> DTensorSpec:
    """The spec ``resize_`` gives ``x``: its whole tensor, replicated.  A sharded self must be
    contiguous (the gathered copy is then the global memory in order)."""
    spec = x._spec
    whole = spec.with_placements([Replicate()] * spec.mesh.ndim)
    if whole != spec and not x.is_contiguous():
        raise unsupported(aten.resize_.default, [spec], "on a sharded non-contiguous tensor (its storage "
                                                        "order is not the gathered copy's); call .contiguous() first")
    return whole


DECOMPOSITIONS[aten.resize_.default] = _resize
DECOMPOSITIONS[aten.resize_as_.default] = lambda x, t, memory_format=None: _resize(x, tuple(t.shape), memory_format)
SELF_BECOMES: dict[Any, Callable[[Any], DTensorSpec]] = {aten.resize_.default: _gathered,
                                                         aten.resize_as_.default: _gathered}
"""In-place decompositions that give their DTensor self new placements and memory: the spec it
will take (a refusal raises there).  Dispatch checks, before they run, that no view shares the
old storage (the view would keep the old placements)."""


@decomposition(aten.allclose.default)
def _allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    return bool(aten.all.default(aten.isclose.default(a, b, rtol, atol, equal_nan)).item())


@decomposition(aten.floor_divide.default)
def _floor_divide(a, b):
    return aten.div.Tensor_mode(a, b, rounding_mode="floor")


@decomposition(aten.floor_divide.Scalar)
def _floor_divide_scalar(a, b):
    return aten.div.Scalar_mode(a, b, rounding_mode="floor")


def _split_sizes(n: int, s: int) -> list[int]:
    if s <= 0:
        raise RuntimeError(f"split expects split_size be non-negative, but got split_size={s}")
    sizes = [s] * (n // s)
    if n % s:
        sizes.append(n % s)
    return sizes or [0]


@decomposition(aten.split.Tensor)
def _split(x, split_size, dim=0):
    d = dim % x.ndim
    return aten.split_with_sizes.default(x, _split_sizes(x.shape[d], split_size), d)


@decomposition(aten.unsafe_split.Tensor)
def _unsafe_split(x, split_size, dim=0):
    d = dim % x.ndim
    return aten.split_with_sizes.default(x, _split_sizes(x.shape[d], split_size), d)


@decomposition(aten.unsafe_split_with_sizes.default)
def _unsafe_split_with_sizes(x, sizes, dim=0):
    return aten.split_with_sizes.default(x, sizes, dim)


@decomposition(aten.unbind.int)
def _unbind(x, dim=0):
    from ..tensor import DTensor

    d = dim % x.ndim
    if isinstance(x, DTensor) and any(p.is_shard(d) for p in x.placements):
        gathered = x.redistribute(x.device_mesh, [Replicate() if p.is_shard(d) else p
                                                  for p in x.placements])
        return Gathered(aten.select.int(gathered, d, i) for i in range(x.shape[d]))  # views of the copy, not of x
    return tuple(aten.select.int(x, d, i) for i in range(x.shape[d]))


@decomposition(aten.split_with_sizes_copy.default)
def _split_with_sizes_copy(x, split_sizes, dim=0):
    return [aten.clone.default(p) for p in aten.split_with_sizes.default(x, split_sizes, dim)]


@decomposition(aten.split_with_sizes_copy.out)
def _split_with_sizes_copy_out(x, split_sizes, dim=0, *, out):
    for o, p in zip(out, aten.split_with_sizes.default(x, split_sizes, dim)):
        o.copy_(p)


@decomposition(aten.lift_fresh.default)
def _lift_fresh(x):
    return x


@decomposition(aten.trace.default)
def _trace(x):
    return aten.sum.dim_IntList(aten.diagonal.default(x), None, False)


# -- plain all-zeros tensors that backward formulas build -----------------------------------

@decomposition(aten.scatter_add.default)
def _scatter_add(self: Any, dim: int, index: Any, src: Any) -> Any:
    """``scatter_reduce(..., "sum", include_self=True)``; a plain all-zeros ``self`` counts as Replicate."""
    from ..tensor import DTensor

    if isinstance(self, torch.Tensor) and not isinstance(self, DTensor):
        self = _replicated(aten.scatter_add.default, self, index if isinstance(index, DTensor) else src)
    return aten.scatter_reduce.two(self, dim, index, src, "sum", include_self=True)


@decomposition(aten.index_put.default)
def _index_put(self: Any, indices: Any, values: Any, accumulate: bool = False) -> Any:
    """``_index_put_impl_`` on a clone; a plain all-zeros ``values`` (what the backward of
    ``index_put`` builds with ``at::zeros``) counts as Replicate."""
    values = _replicated(aten.index_put.default, values, self)
    out = _as_decided(aten._index_put_impl_.default, aten.clone.default(self), indices, values, accumulate, False)
    aten._index_put_impl_.default(out, indices, values, accumulate, False)
    return out


@decomposition(aten.index_copy.default)
def _index_copy(self: Any, dim: int, index: Any, source: Any) -> Any:
    """``index_put`` with the index at ``dim`` (one advanced index keeps its place), so the
    result takes the source's layout where that moves less than gathering it."""
    if self.ndim == 0:  # no dim to index: torch's own decomposition
        from torch._decomp import decomposition_table

        return decomposition_table[aten.index_copy.default](self, dim, index, source)
    return _index_put(self, [None] * (dim % self.ndim) + [index], source)


def _as_decided(op: Any, out: Any, *args: Any) -> Any:
    """A fresh ``out`` (a clone) in the placements ``op``'s rule wants for its self: an in-place
    op keeps its self's placements, so a clone the op writes into is laid out first (a local
    slice or split of a replica, no communication) where the rule prefers another layout."""
    from ..propagation import flatten_call, propagate
    from ..tensor import DTensor, _Redistribute

    if not isinstance(out, DTensor):
        return out
    flat, treedef = flatten_call((out, *args), {})
    specs = [a._spec if isinstance(a, DTensor) else None for a in flat]
    want = propagate(op, flat, specs, treedef).inputs[0]
    if want is None or want == out._spec:
        return out
    return _Redistribute.apply(out, want, None, None, False)


def _replicated(op: Any, t: Any, ref: Any) -> Any:
    """A plain tensor among DTensors as a Replicate DTensor on ``ref``'s mesh, where a plain tensor
    may be taken as replicated (``implicit``: backward formulas, decompositions, one element)."""
    from ..implicit import implicit_allowed, plain_tensor_error
    from ..tensor import DTensor

    if not isinstance(t, torch.Tensor) or isinstance(t, DTensor) or t.ndim == 0 or not isinstance(ref, DTensor):
        return t
    if not implicit_allowed(t):
        raise plain_tensor_error(op, t)
    return wrap_replicated(t, ref.device_mesh)


# -- fused SGD ------------------------------------------------------------------------------

def _fused_sgd(op) -> Callable[..., None]:
    """``_fused_sgd_`` whose momentum buffers are placed unlike their params (its rule runs the
    fused kernel otherwise): the same update in foreach ops.

    Torch creates the first momentum buffers with ``empty_like(grad)``, so a ``Partial`` grad
    gives a ``Partial`` buffer that the fused kernel cannot update in place; the foreach form
    keeps such a buffer ``Partial`` (as ``foreach=True`` SGD does).
    """

    def run(params, grads, bufs, *, weight_decay, momentum, lr, dampening, nesterov, maximize, is_first_step,
            grad_scale=None, found_inf=None) -> None:
        from ..tensor import DTensor

        if grad_scale is not None or found_inf is not None:
            raise unsupported(op, [t._spec for t in [*params, *grads, *bufs] if isinstance(t, DTensor)],
                              "with grad_scale/found_inf and momentum buffers placed unlike their params")
        if isinstance(lr, torch.Tensor):
            lr = lr.item()
        g = torch._foreach_neg(grads) if maximize else list(grads)
        if weight_decay != 0:
            g = torch._foreach_add(g, params, alpha=weight_decay)
        if momentum != 0:
            if is_first_step:
                torch._foreach_copy_(bufs, g)
            else:
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, g, alpha=1 - dampening)
            g = torch._foreach_add(g, bufs, alpha=momentum) if nesterov else bufs
        torch._foreach_add_(params, g, alpha=-lr)
        return None

    return run


for _op in overloads("_fused_sgd_"):
    DECOMPOSITIONS[_op] = _fused_sgd(_op)


# -- random ops -----------------------------------------------------------------------------

@decomposition(aten.rrelu_with_noise.default)
def _rrelu_with_noise(x, noise, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    """Training: a slope drawn from ``U(lower, upper)`` per negative element (through the DTensor
    random fill, so the draw is one device's, sliced), written into ``noise`` (1 elsewhere), as
    torch's kernel does; evaluation: ``leaky_relu`` with the mean slope, ``noise`` untouched."""
    if not training:
        return aten.leaky_relu.default(x, (lower + upper) / 2)
    slope = aten.uniform.default(x, lower, upper, generator=generator)
    aten.copy_.default(noise, aten.where.ScalarSelf(aten.ge.Scalar(x, 0), 1.0, slope))
    return aten.mul.Tensor(x, noise)


@decomposition(aten.rrelu_with_noise_backward.default)
def _rrelu_with_noise_backward(grad, x, noise, lower, upper, training, self_is_result):
    if training and upper - lower > 1e-6:
        return aten.mul.Tensor(grad, noise)
    return aten.leaky_relu_backward.default(grad, x, (lower + upper) / 2, self_is_result)
