"""Embedding lookup and its dense backward: candidates per mesh dim, cheapest by modeled cost.

``embedding(weight[V, D], indices[*I]) -> out[*I, D]``, per mesh dim:

| candidate | weight | indices | output |
|---|---|---|---|
| replicate | `R` | `R` | `R` |
| batch | `R` | `S(d)` | `S(d)` |
| column-wise | `S(1)` | `R` | `S(last)` |
| row-wise (vocab parallel) | `S(0)` | `R` | `P(sum)`, custom kernel |
| partial weight | `P(any kind)` (as it is now) | `R` | same `P` (a lookup commutes with every elementwise combine) |

Row-wise kernel: each rank looks up only the indices in its row range ``[off, off + rows)``
and writes zeros for the others, so the per-rank terms sum to the lookup (uneven and empty
row shards included).  No placement carries state, so decisions stay cacheable.

``embedding_dense_backward(grad[*I, D], indices[*I], V, padding_idx, scale) -> gw[V, D]``:

| candidate | grad_output | indices | grad weight |
|---|---|---|---|
| replicate | `R` | `R` | `R` |
| batch | `S(d)` | `S(d)` | `P(sum)` (not with ``scale_grad_by_freq``: counts are global) |
| column | `S(last)` | `R` | `S(1)` |
| partial grad | `P(sum)`/`P(avg)` | `R` | same `P` (the scatter-add is linear) |

``_embedding_bag(weight[V, D], indices, offsets, ...) -> (out[B, D], offset2bag, bag_size,
max_indices)`` (and ``_embedding_bag_forward_only``), per mesh dim: replicate; column-wise
(weight ``S(1)`` -> out ``S(1)``, and max_indices ``S(1)`` in max mode, where it is ``[B, D]``);
a ``P(sum)``/``P(avg)`` weight or per-sample weights in sum and mean modes (out linear in each;
the index outputs stay R).  Its backwards: ``_embedding_bag_backward`` and
``_embedding_bag_dense_backward`` take grad ``S(1)`` -> ``S(1)`` or a linear ``P`` -> ``P``;
``_embedding_bag_per_sample_weights_backward`` (a dot of grad and weight rows) takes both on
``S(1)`` -> ``P(sum)``, or either one linear ``P`` with the other R -> ``P``.  Sparse gradients raise.

A row-wise weight receives an `R` or `P(sum)` gradient: the gradient's value is exact, and an
optimizer step ``w.add_(g)`` on the `S(0)` weight brings it to `S(0)` locally (`R`) or by a
reduce-scatter (`P(sum)`).
"""
from __future__ import annotations

from typing import Callable

import torch

from ...placement import Partial, Replicate, Shard
from ...spec import DTensorSpec
from ..call import Call, Decision
from ..registry import register
from ..strategy import Option, decide, expand, linear_partial, select
from .matrix import label_decision

aten = torch.ops.aten

VOCAB, EMB = "vocab", "emb"


def _labels(nd: int) -> tuple:
    return tuple(("i", d) for d in range(nd))


@register(aten.embedding.default, needs=("weight", "indices"))
def embedding_rule(call: Call) -> Decision:
    """Lookup: replicate / batch / column-wise / row-wise (masked, P(sum)) / partial weight."""
    wpos, ipos = call.pos("weight"), call.pos("indices")
    w, idx = call.specs[wpos], call.specs[ipos]
    if w.ndim != 2:
        raise call.refuse(f"with a {w.ndim}-D weight")
    n = idx.ndim
    options: list[list[Option]] = []
    for j in range(call.mesh.ndim):
        opts: list[Option] = [({}, Replicate())]
        opts += [({ipos: Shard(d)}, Shard(d)) for d in range(n)]
        opts.append(({wpos: Shard(1)}, Shard(n)))
        opts.append(({wpos: Shard(0)}, Partial("sum")))
        p = w.placements[j]
        if p.is_partial():
            opts.append(({wpos: p}, p))
        options.append(opts)
    cand = select(call, expand(options, [wpos, ipos]))
    labels = {wpos: (VOCAB, EMB), ipos: _labels(n)}
    rowwise = any(p == Shard(0) for p in cand.inputs[wpos])

    def kernel(targets: dict[int, DTensorSpec]) -> Callable | None:
        return _rowwise_lookup(targets[wpos]) if rowwise else None

    return label_decision(call, cand, labels, _labels(n) + (EMB,), kernel=kernel)


def _rowwise_lookup(wspec: DTensorSpec) -> Callable:
    """Local step of a row-sharded weight: rows outside this rank's range give zeros."""

    def kernel(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
               scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
        (rows, _), (off, _) = wspec.local_shape_and_offset()
        shape = (*indices.shape, weight.shape[1])
        if rows == 0:
            return weight.new_zeros(shape)
        mask = (indices >= off) & (indices < off + rows)
        local = torch.where(mask, indices - off, torch.zeros_like(indices))
        out = torch.embedding(weight, local)
        return torch.where(mask.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype))

    return kernel


@register(aten.embedding_dense_backward.default, needs=("grad_output", "indices"))
def embedding_dense_backward_rule(call: Call) -> Decision:
    """Grad weight: R, P(sum) from a batch-sharded grad, S(1) from an emb-sharded grad, or a linear P."""
    gpos, ipos = call.pos("grad_output"), call.pos("indices")
    g, idx = call.specs[gpos], call.specs[ipos]
    n = idx.ndim
    scale = bool(call.arg("scale_grad_by_freq", False))
    options: list[list[Option]] = []
    for j in range(call.mesh.ndim):
        opts: list[Option] = [({}, Replicate())]
        if not scale:
            opts += [({gpos: Shard(d), ipos: Shard(d)}, Partial("sum")) for d in range(n)]
        opts.append(({gpos: Shard(n)}, Shard(1)))
        p = g.placements[j]
        if linear_partial(p):
            opts.append(({gpos: p}, p))
        options.append(opts)
    cand = select(call, expand(options, [gpos, ipos]))
    labels = {gpos: _labels(n) + (EMB,), ipos: _labels(n)}
    return label_decision(call, cand, labels, (VOCAB, EMB))


# -- embedding_bag ---------------------------------------------------------------------------

@register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default,
          needs=("weight", "indices", "offsets"))
def embedding_bag_rule(call: Call) -> Decision:
    """Bags of rows: column-wise, or a linear Partial weight (or per-sample weights) in sum/mean."""
    wpos, ipos, opos, ppos = (call.pos(n) for n in ("weight", "indices", "offsets", "per_sample_weights"))
    if bool(call.arg("sparse", False)):
        raise call.refuse("with sparse=True")
    mode = int(call.arg("mode", 0))
    r = Replicate()
    max_cols = Shard(1) if call.out_meta[3].ndim == 2 else r
    options: list[list[Option]] = []
    for j in range(call.mesh.ndim):
        opts: list[Option] = [({}, (r, r, r, r)), ({wpos: Shard(1)}, (Shard(1), r, r, max_cols))]
        for pos in (wpos, ppos):
            p = call.specs[pos].placements[j] if pos is not None else r
            if mode != 2 and linear_partial(p):
                opts.append(({pos: p}, (p, r, r, r)))
        options.append(opts)
    positions = [x for x in (wpos, ipos, opos, ppos) if x is not None]
    return decide(call, expand(options, positions))


@register(aten._embedding_bag_backward.default, aten._embedding_bag_dense_backward.default, needs=("grad",))
def embedding_bag_backward_rule(call: Call) -> Decision:
    """Grad weight rows are sums of grad rows: the emb dim's shards and linear partials pass."""
    gpos, mpos = call.pos("grad"), call.pos("maximum_indices")
    if bool(call.arg("sparse", False)):
        raise call.refuse("with sparse=True")
    g = call.specs[gpos]
    cols = {gpos: Shard(1)}
    if mpos is not None and call.specs[mpos].ndim == 2:
        cols[mpos] = Shard(1)
    positions = [i for i, s in enumerate(call.specs) if s is not None]
    options: list[list[Option]] = []
    for j in range(call.mesh.ndim):
        opts: list[Option] = [({}, Replicate()), (cols, Shard(1))]
        if linear_partial(g.placements[j]):
            opts.append(({gpos: g.placements[j]}, g.placements[j]))
        options.append(opts)
    return decide(call, expand(options, positions))


@register(aten._embedding_bag_per_sample_weights_backward.default, needs=("grad", "weight"))
def embedding_bag_psw_backward_rule(call: Call) -> Decision:
    """Per-sample grads are dots of grad rows with weight rows: split D gives P(sum) terms."""
    gpos, wpos = call.pos("grad"), call.pos("weight")
    positions = [i for i, s in enumerate(call.specs) if s is not None]
    options: list[list[Option]] = []
    for j in range(call.mesh.ndim):
        opts: list[Option] = [({}, Replicate()), ({gpos: Shard(1), wpos: Shard(1)}, Partial("sum"))]
        for pos in (gpos, wpos):
            p = call.specs[pos].placements[j]
            if linear_partial(p):
                opts.append(({pos: p}, p))
        options.append(opts)
    return decide(call, expand(options, positions))
