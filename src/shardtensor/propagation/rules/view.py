"""Views that only add or drop size-1 dims (what autograd's ``sum_to_size`` emits).

The dims of length > 1 keep their order, so each shard maps to its new dim; a mesh dim that
shards a dropped length-1 dim must replicate first.  Each rank's size argument becomes its
local shape.  General reshapes belong to the view-op rules (not yet built) and raise.
"""
from __future__ import annotations

import torch

from ...placement import Placement, Replicate, Shard
from ...spec import DTensorSpec
from .. import Call, Decision, register, unsupported

aten = torch.ops.aten


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def unit_dims_view_rule(call: Call) -> Decision:
    s = call.specs[0]
    out = call.out_meta
    in_keep = [d for d, n in enumerate(s.shape) if n != 1]
    out_keep = [d for d, n in enumerate(out.shape) if n != 1]
    if [s.shape[d] for d in in_keep] != [out.shape[d] for d in out_keep]:
        raise unsupported(call.op, call.specs, f"from {tuple(s.shape)} to {tuple(out.shape)} (only size-1 dims may change)")
    where = dict(zip(in_keep, out_keep))
    need: list[Placement] = []
    out_pl: list[Placement] = []
    for p in s.placements:
        if isinstance(p, Shard) and p.dim not in where:
            p = Replicate()
        need.append(p)
        out_pl.append(Shard(where[p.dim]) if isinstance(p, Shard) else p)
    required = s.with_placements(need, tuple((d, js) for d, js in s.shard_order if d in where))
    order = tuple((where[d], js) for d, js in required.shard_order)
    out_spec = DTensorSpec.build(s.mesh, out_pl, out.shape, out.stride(), out.dtype, order)
    n = len(out.shape)

    def local_args(flat: list) -> list:
        flat = list(flat)
        flat[1:1 + n] = list(out_spec.local_shape)
        return flat

    inputs = tuple(required if i == 0 else None for i in range(len(call.flat)))
    return Decision(inputs, out_spec, required != s, local_args)
