"""``new_*`` factories called on a DTensor with its own global size (autograd uses them).

The output takes ``self``'s placements (Partial becomes Replicate: a fill is not a term),
and each rank's size arguments are rewritten to its local shape after the cache lookup, so
the cached decision stays rank independent.  Other sizes raise NotImplementedError.
"""
from __future__ import annotations

import torch

from ...placement import Replicate
from ...spec import DTensorSpec, contiguous_stride
from .. import Call, Decision, register, unsupported

aten = torch.ops.aten


@register(aten.new_empty_strided.default, aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
          aten.new_full.default)
def new_factory_rule(call: Call) -> Decision:
    s = call.specs[0]
    size = call.flat[1:1 + len(s.shape)]
    if tuple(call.out_meta.shape) != tuple(s.shape) or list(size) != list(s.shape):
        raise unsupported(call.op, call.specs, f"with size {tuple(call.out_meta.shape)} != self's {tuple(s.shape)}")
    keep = call.op in (aten.new_empty_strided.default, aten.new_empty.default, aten.new_zeros.default)
    pl = s.placements if keep else tuple(Replicate() if p.is_partial() else p for p in s.placements)
    out = DTensorSpec.build(s.mesh, pl, s.shape, call.out_meta.stride(), call.out_meta.dtype, s.shard_order)
    n = len(s.shape)
    strided = call.op is aten.new_empty_strided.default

    def local_args(flat: list) -> list:
        shape = out.local_shape
        flat = list(flat)
        flat[1:1 + n] = list(shape)
        if strided:
            flat[1 + n:1 + 2 * n] = list(contiguous_stride(shape))
        return flat

    return Decision(tuple(call.specs), out, False, local_args)
