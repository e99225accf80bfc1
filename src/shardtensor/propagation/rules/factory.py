"""``new_*`` factories called on a DTensor.

| size argument | output | local call |
|---|---|---|
| ``self``'s global shape | ``self``'s placements and shard order (Partial kept for ``new_empty``/``new_zeros``/``new_empty_strided``, whose values are a valid term of every kind; Replicate for ``new_ones``/``new_full``) | sizes -> this rank's local shape; ``new_empty_strided``: strides dense over the local shape, dims in the order of the global strides |
| any other size | Replicate | the global sizes and strides unchanged |

The rewrite of size/stride arguments happens per rank after the cache lookup, so the cached
decision stays rank independent.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ...placement import Replicate, unpartial
from ...spec import DTensorSpec
from ..call import Call, Decision
from ..registry import register
from ..strategy import finish

aten = torch.ops.aten

__all__ = ["new_factory_rule", "dense_stride_like", "put_sizes"]

KEEPS_PARTIAL = (aten.new_empty_strided.default, aten.new_empty.default, aten.new_zeros.default)


def dense_stride_like(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """Dense strides over ``shape`` that order the dims as ``stride`` does (innermost = smallest stride)."""
    order = sorted(range(len(shape)), key=lambda d: (stride[d], -d))
    out = [0] * len(shape)
    acc = 1
    for d in order:
        out[d] = acc
        acc *= max(shape[d], 1)
    return tuple(out)


def put_sizes(flat: list, slots: Any, values: Sequence[int]) -> list:
    """A copy of the flat local args with the size argument at ``slots`` (see ``Call.slots``) set to ``values``."""
    flat = list(flat)
    if isinstance(slots, (list, tuple)):
        for s, v in zip(slots, values):
            flat[s] = v
    elif slots is not None:
        flat[slots] = list(values)
    return flat


@register(aten.new_empty_strided.default, aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
          aten.new_full.default)
def new_factory_rule(call: Call) -> Decision:
    """Follow ``self`` when the size is its shape, else a Replicate output with global sizes."""
    s = call.specs[0]
    meta = call.out_meta
    if tuple(meta.shape) != tuple(s.shape):
        out = DTensorSpec.build(s.mesh, [Replicate()] * s.mesh.ndim, meta.shape, meta.stride(), meta.dtype)
        return finish(call, {}, out)
    keep = call.op in KEEPS_PARTIAL
    pl = s.placements if keep else unpartial(s.placements)
    out = DTensorSpec.build(s.mesh, pl, s.shape, meta.stride(), meta.dtype, s.shard_order)
    if not any(p.is_shard() for p in pl):
        return finish(call, {}, out)
    size_slots = call.slots("size")
    stride_slots = call.slots("stride") if call.op is aten.new_empty_strided.default else None
    global_stride = tuple(meta.stride())

    def local_args(flat: list) -> list:
        shape = out.local_shape
        flat = put_sizes(flat, size_slots, shape)
        if stride_slots is not None:
            flat = put_sizes(flat, stride_slots, dense_stride_like(shape, global_stride))
        return flat

    return finish(call, {}, out, local_args=local_args)
