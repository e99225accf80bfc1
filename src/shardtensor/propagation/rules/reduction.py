"""``sum`` over dims: a sharded reduced dim becomes Partial(sum) -- no communication.

Needed by autograd to reduce broadcast gradients.  Partial(sum|avg) inputs stay Partial
(sum is linear); other Partial kinds are reduced to Replicate first.  Empty local shards sum
to 0, the identity of Partial(sum), so uneven shards are exact.
"""
from __future__ import annotations

import torch

from ...placement import Partial, Placement, Replicate, Shard
from ...spec import DTensorSpec
from .. import Call, Decision, register

aten = torch.ops.aten


@register(aten.sum.default, aten.sum.dim_IntList)
def sum_rule(call: Call) -> Decision:
    s = call.specs[0]
    nd = s.ndim
    args, kwargs = call.args_kwargs()
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        reduced = set(range(nd))
    else:
        dims = [dims] if isinstance(dims, int) else dims
        reduced = {d % max(nd, 1) for d in dims}
    need: list[Placement] = []
    out_pl: list[Placement] = []
    for p in s.placements:
        if isinstance(p, Partial) and p.reduce_op not in ("sum", "avg"):
            p = Replicate()
        need.append(p)
        if isinstance(p, Shard):
            if p.dim in reduced:
                out_pl.append(Partial("sum"))
            else:
                out_pl.append(Shard(p.dim if keepdim else p.dim - sum(1 for d in reduced if d < p.dim)))
        else:
            out_pl.append(p)
    order = tuple((d if keepdim else d - sum(1 for e in reduced if e < d), js) for d, js in s.shard_order if d not in reduced)
    required = s.with_placements(need, s.shard_order)
    meta = call.out_meta
    out = DTensorSpec.build(s.mesh, out_pl, meta.shape, meta.stride(), meta.dtype, order)
    inputs = tuple(required if i == 0 else None for i in range(len(call.flat)))
    return Decision(inputs, out, required != s)
