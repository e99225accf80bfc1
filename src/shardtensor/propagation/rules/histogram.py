"""Counting, binning and drawing: ``histc`` on any placement, ``searchsorted`` and ``bucketize``
with the values sharded, ``multinomial`` with the batch dim sharded.

| op | required | output |
|---|---|---|
| ``histc`` | partials reduced (counting is not linear); shards kept | ``P(sum)`` on every mesh dim that shards the input (local histograms add up), R elsewhere; with ``min == max`` the bounds are the global min and max (one small all-reduce) |
| ``searchsorted.Tensor`` | a 1-D sequence (and ``sorter``) R, the values on any ``S``; an N-D sequence, values and sorter on ``S(d)`` of a batch dim ``d`` (all but the last); partials reduced (a position is not linear) | the values' placements |
| ``bucketize.Tensor`` | boundaries R, the values on any ``S``; partials reduced | the values' placements |
| ``multinomial`` | the categories dim gathered; partials reduced; a sharded batch dim kept | the batch dim's shards, R elsewhere |

``multinomial`` draws the GLOBAL uniform numbers as the other random ops do (see
``shardtensor.rng``), each rank keeping its rows' part, so the result does not depend on the
placements (it is not torch's own stream of draws).  With replacement a row inverts its CDF
at uniform draws; without replacement it takes the top ``num_samples`` of ``log(p)`` plus
Gumbel noise (the same distribution as torch's sequential draws).
"""
from __future__ import annotations

from typing import Any

import torch

from ... import comm
from ...placement import Partial, Placement, Replicate, Shard
from ...spec import DTensorSpec
from ..call import Call, Decision
from ..registry import register
from ... import rng
from ..strategy import Option, decide, expand, finish, no_partial
from .misc import gather_dims

aten = torch.ops.aten

__all__ = ["histc_rule", "searchsorted_rule", "bucketize_rule", "multinomial_rule"]


def _bounds(x: torch.Tensor, lo: float, hi: float, mesh: Any, sharded: bool) -> tuple[float, float]:
    """torch's bounds: the data's global min and max when ``min == max``, widened by 1 if still equal.

    One all-reduce (max of ``(-min, max)``) over the mesh when the data is sharded: replicated mesh
    dims hold the same values, so the whole mesh gives the same extremes."""
    if lo == hi:
        ends = (torch.stack([-x.min(), x.max()]).to(torch.float64) if x.numel()
                else torch.full((2,), -float("inf"), dtype=torch.float64, device=x.device))
        if sharded:
            ends = comm.all_reduce(ends, "max", mesh, None)
        lo, hi = (-float(ends[0]), float(ends[1])) if torch.isfinite(ends[0]) else (0.0, 0.0)
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    return lo, hi


@register(aten.histc.default)
def histc_rule(call: Call) -> Decision:
    s = gather_dims(call.specs[0], lambda d: True, no_partial)
    mesh = s.mesh
    dims = [j for j, p in enumerate(s.placements) if isinstance(p, Shard) and mesh.shape[j] > 1]
    out_pl: list[Placement] = [Partial("sum") if j in dims else Replicate() for j in range(mesh.ndim)]
    meta = call.out_meta
    out = DTensorSpec.build(mesh, out_pl, meta.shape, meta.stride(), meta.dtype)

    def kernel(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
        lo, hi = _bounds(x, float(min), float(max), mesh, bool(dims))
        return torch.histc(x, bins, lo, hi)

    return finish(call, {0: s}, out, kernel=kernel)


def _check_probabilities(rows: torch.Tensor, num_samples: int, replacement: bool, spec: DTensorSpec) -> None:
    """torch's checks, agreed over the mesh so that every rank raises together."""
    bad = 0
    if rows.numel() and (not torch.isfinite(rows).all() or (rows < 0).any() or (rows.sum(-1) <= 0).any()):
        bad = 1
    elif rows.numel() and not replacement and int((rows > 0).sum(-1).min()) < num_samples:
        bad = 2
    flag = comm.all_reduce(torch.tensor(bad, dtype=torch.int64, device=rows.device), "max", spec.mesh, None)
    if int(flag) == 1:
        raise RuntimeError("multinomial: probability tensor contains either inf, nan or element < 0, or a row "
                           "sums to 0 (on some rank)")
    if int(flag) == 2:
        raise RuntimeError("multinomial: cannot sample n_sample > prob_dist.size(-1) samples without replacement "
                           "(not enough non-zero categories on some rank)")


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
    positions = [x for x in (qp, vp, sp) if x is not None]
    return decide(call, expand([opt] * call.mesh.ndim, positions))


@register(aten.bucketize.Tensor, needs=("self", "boundaries"))
def bucketize_rule(call: Call) -> Decision:
    """Each value's bucket among replicated boundaries: the values' shards kept."""
    vp, bp = call.pos("self"), call.pos("boundaries")
    v = call.specs[vp]
    opt: list[Option] = [({}, Replicate())] + [({vp: Shard(d)}, Shard(d)) for d in range(v.ndim)]
    return decide(call, expand([opt] * call.mesh.ndim, [vp, bp]))


@register(aten.multinomial.default)
def multinomial_rule(call: Call) -> Decision:
    s = call.specs[0]
    keep: list[Placement] = [p if isinstance(p, Shard) and p.dim == 0 and s.ndim == 2 else Replicate()
                             for p in s.placements]
    need = s.with_placements(keep)
    meta = call.out_meta
    out = DTensorSpec.build(s.mesh, keep, meta.shape, meta.stride(), meta.dtype)
    shape = tuple(s.shape) if s.ndim == 2 else (1, s.shape[0])
    one_row = s.ndim == 1

    def kernel(p: torch.Tensor, num_samples: int, replacement: bool = False, *,
               generator: torch.Generator | None = None) -> torch.Tensor:
        rows = p.reshape(-1, p.shape[-1]).to(torch.float64)
        _check_probabilities(rows, num_samples, replacement, need)
        (n, *_), (o, *_) = ((1,), (0,)) if one_row else need.local_shape_and_offset()
        u_shape = (shape[0], num_samples) if replacement else shape
        u = rng.draw(s.mesh, generator, p.device,
                     lambda g: torch.rand(u_shape, generator=g, dtype=torch.float64, device=p.device)).narrow(0, o, n)
        if replacement:
            cdf = rows.cumsum(-1)
            idx = torch.searchsorted(cdf, (u * cdf[:, -1:]).contiguous(), right=True).clamp_(max=shape[1] - 1)
        else:
            keys = rows.log() - (-u.clamp_min(1e-300).log()).log()
            idx = keys.topk(num_samples, dim=-1).indices
        return idx.reshape(meta.shape if one_row else (p.shape[0], num_samples))

    return finish(call, {0: need}, out, kernel=kernel)
