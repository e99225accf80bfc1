"""Decompositions: ops without a rule rewritten into ops that have one, before any error.

Three sources, tried in order for an op that has no rule:

1. ``DECOMPOSITIONS`` -- our own table: ``max.dim`` into
   ``amax`` + ``argmax``, ``var_mean``, generic ``sum``/``squeeze``, ``floor_divide``,
   ``split.Tensor``, ``unbind``, ``split_with_sizes_copy``, ``trace``, ``lift_fresh`` ...
2. ``out=`` overloads: the functional overload, then ``copy_`` into each ``out`` tensor (the
   copy rule redistributes the result to ``out``'s placements).
3. PyTorch's own decompositions: the op's CompositeImplicitAutograd kernel
   (``OpOverload.decompose``), then ``torch._decomp.decomposition_table``.

A decomposition runs on the DTensors themselves, so every op it emits goes through dispatch
(with its own rule, cache entry and redistribution).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import PropagationError

aten = torch.ops.aten

__all__ = ["DECOMPOSITIONS", "decomposition", "find_decomposition"]

DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {}


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
    try:
        from torch._decomp import decomposition_table
    except ImportError:  # pragma: no cover
        return None
    return decomposition_table.get(op)


# -- our own decompositions ----------------------------------------------------------------

def _all_dims(x) -> list[int]:
    return list(range(x.ndim))


@decomposition(aten.sum.default)
def _sum_default(x, *, dtype=None):
    return aten.sum.dim_IntList(x, None, False, dtype=dtype)


def _max_min_dim(largest: bool) -> Callable:
    def run(x, dim, keepdim=False):
        from ..placement import Replicate, Shard
        from ..tensor import DTensor

        d = dim % max(x.ndim, 1)
        if isinstance(x, DTensor):
            # both outputs come from one gathered input (argmax needs dim gathered anyway)
            pl = [Replicate() if (isinstance(p, Shard) and p.dim == d) or p.is_partial() else p for p in x.placements]
            if tuple(pl) != x.placements:
                x = x.redistribute(x.device_mesh, pl)
        vals = (aten.amax if largest else aten.amin)(x, [d], keepdim)
        ranked = x.to(torch.uint8) if x.dtype == torch.bool else x  # argmax has no bool kernel; max.dim has
        idx = (aten.argmax if largest else aten.argmin)(ranked, d, keepdim)
        return vals, idx

    return run


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
    from ..placement import Replicate, Shard
    from ..tensor import DTensor

    from ..aliasing import note_copies

    d = dim % x.ndim
    if isinstance(x, DTensor) and any(isinstance(p, Shard) and p.dim == d for p in x.placements):
        gathered = x.redistribute(x.device_mesh, [Replicate() if isinstance(p, Shard) and p.dim == d else p
                                                  for p in x.placements])
        rows = tuple(aten.select.int(gathered, d, i) for i in range(x.shape[d]))
        note_copies(aten.unbind.int, x, True, rows)  # the rows are views of the gathered copy, not of x
        return rows
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
