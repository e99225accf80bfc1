"""Counting, binning and drawing: ``histc`` on any placement, ``searchsorted`` and ``bucketize``
with the values or the sorted sequence sharded, ``multinomial`` with the batch dim sharded.

| op | required | output |
|---|---|---|
| ``histc`` | partials reduced (counting is not linear), by a reduce-scatter where cheaper; shards kept | ``P(sum)`` on every mesh dim that shards the input (local histograms add up), R elsewhere; with ``min == max`` the bounds are the global min and max (one small all-reduce) |
| ``searchsorted.Tensor`` | a 1-D sequence (and ``sorter``) R, the values on any ``S``, or (no ``sorter``) the sequence ``S(0)`` -> ``P(sum)``; an N-D sequence, values and sorter on ``S(d)`` of a batch dim ``d`` (all but the last); partials reduced (a position is not linear) | the values' placements |
| ``bucketize.Tensor`` | boundaries R, the values on any ``S``; or boundaries ``S(0)``, values R -> ``P(sum)`` (a bucket is the count of boundaries below: each sorted piece counts its own); partials reduced | the values' placements |
| ``multinomial`` | the categories dim gathered; partials reduced; a sharded batch dim kept | the batch dim's shards, R elsewhere |

``multinomial`` draws the GLOBAL uniform numbers as the other random ops do (see
``shardtensor.rng``), each rank keeping its rows' part, so the result does not depend on the
placements (it is not torch's own stream of draws).  With replacement a row inverts its CDF
at uniform draws; without replacement it takes the top ``num_samples`` of ``log(p)`` plus
Gumbel noise (the same distribution as torch's sequential draws).
"""
from __future__ import annotations


import torch

from ...placement import Partial, Placement, Replicate, Shard
from ...spec import DTensorSpec
from .. import kernels
from ..call import Call, Decision
from ..registry import register
from ..strategy import Option, decide, expand, finish, no_partial, shard_instead
from .misc import gather_dims

aten = torch.ops.aten

__all__ = ["histc_rule", "searchsorted_rule", "bucketize_rule", "multinomial_rule"]


@register(aten.histc.default)
def histc_rule(call: Call) -> Decision:
    x = call.specs[0]
    s = gather_dims(x, lambda d: True, no_partial)
    pl = shard_instead(call, 0, s.placements, range(x.ndim), alone=True)  # a Partial reduce-scattered
    s = s if pl == s.placements else x.with_placements(pl)
    mesh = s.mesh
    dims = [j for j, p in enumerate(s.placements) if p.is_shard() and mesh.shape[j] > 1]
    out_pl: list[Placement] = [Partial("sum") if j in dims else Replicate() for j in range(mesh.ndim)]
    meta = call.out_meta
    out = DTensorSpec.build(mesh, out_pl, meta.shape, meta.stride(), meta.dtype)

    return finish(call, {0: s}, out, kernel=kernels.histc(mesh, bool(dims)))


@register(aten.searchsorted.Tensor, needs=("sorted_sequence", "self"))
def searchsorted_rule(call: Call) -> Decision:
    """Each value's position in its own row of the sequence: values split freely over a 1-D
    sequence, and with an N-D one over the batch dims they share with it."""
    qp, vp, sp = call.pos("sorted_sequence"), call.pos("self"), call.pos("sorter")
    q, v = call.specs[qp], call.specs[vp]
    batch = q.ndim > 1
    dims = range(q.ndim - 1) if batch else range(v.ndim)
    opt: list[Option] = [({}, Replicate())]
    for d in dims:
        row = {qp: Shard(d), vp: Shard(d)} if batch else {vp: Shard(d)}
        if batch and sp is not None:
            row[sp] = Shard(d)
        opt.append((row, Shard(d)))
    if not batch and sp is None:
        opt.append(({qp: Shard(0)}, Partial("sum")))  # local positions in sorted pieces add up
    positions = [x for x in (qp, vp, sp) if x is not None]
    return decide(call, expand([opt] * call.mesh.ndim, positions))


@register(aten.bucketize.Tensor, needs=("self", "boundaries"))
def bucketize_rule(call: Call) -> Decision:
    """Each value's bucket: the values' shards kept, or the boundaries' (a value's bucket is the
    number of boundaries below it, the sum of the counts in each sorted piece: ``P(sum)``)."""
    vp, bp = call.pos("self"), call.pos("boundaries")
    v = call.specs[vp]
    opt: list[Option] = [({}, Replicate())] + [({vp: Shard(d)}, Shard(d)) for d in range(v.ndim)]
    opt.append(({bp: Shard(0)}, Partial("sum")))
    return decide(call, expand([opt] * call.mesh.ndim, [vp, bp]))


@register(aten.multinomial.default)
def multinomial_rule(call: Call) -> Decision:
    s = call.specs[0]
    keep: list[Placement] = [p if p.is_shard(0) and s.ndim == 2 else Replicate()
                             for p in s.placements]
    need = s.with_placements(keep)
    meta = call.out_meta
    out = DTensorSpec.build(s.mesh, keep, meta.shape, meta.stride(), meta.dtype)
    shape = tuple(s.shape) if s.ndim == 2 else (1, s.shape[0])
    kernel = kernels.multinomial(s.mesh, need, shape, s.ndim == 1, meta.shape)
    return finish(call, {0: need}, out, kernel=kernel)
