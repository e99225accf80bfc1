"""Matrix products: candidates per mesh dim from index labels, expanded to the mesh, scored by cost.

Each op is an einsum over labelled dims (``m``, ``k``, ``n``, batch ``b``); per mesh dim the
candidates are (placements of the operands -> placement of the output):

| candidate | operands | output |
|---|---|---|
| all replicate | every operand `R` | `R` |
| shard a kept label `L` (m, n, b) | `S(dim of L)` where the operand has `L`, else `R` | `S(dim of L)` |
| shard the contracted label `k` | `S(dim of k)` in every operand | `P(sum)` (no communication) |
| keep a linear partial | one operand `P(sum)` or `P(avg)` (as it is now), the others `R` | same `P` |

| op | labels |
|---|---|
| `mm` | `mk, kn -> mn` |
| `bmm` | `bmk, bkn -> bmn` |
| `mv` | `mk, k -> m` |
| `dot` | `k, k -> ()` |
| `addmm`, `baddbmm`, `addmv` | as `mm`, `bmm`, `mv`, plus a broadcast bias ``self`` |

Only one operand is ever partial on a mesh dim (a product is linear in each operand
separately, never jointly).  The mesh-wide candidates are the cartesian product of the per-dim
ones; the engine picks the cheapest by the planner's modeled cost.

The bias of ``addmm``-style ops (``beta*self + alpha*(A@B)``) follows the output: `S` where the
output is sharded on a dim the bias does not broadcast (else `R`), `R` where it is `R`, and the
output's `P(kind)` where it is partial (a replicated bias is partitioned locally, so each rank's
``beta*self_r`` terms add up to ``beta*self``).

Nested sharding (several mesh dims on one label) keeps the shard order of an operand that
already has those placements; every other tensor carrying the label, and the output, use
that order (operands with another order are reordered).

``torch.matmul`` and ``F.linear`` are composite and reach these rules as ``mm``/``bmm``/``mv``/
``dot``/``addmm`` after ``view``/``expand``/``t``/``transpose`` (view rules).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Hashable, Sequence

import torch

from ...placement import Partial, Placement, Replicate, Shard
from ...spec import DTensorSpec
from ..call import Call, Decision
from ..registry import register
from ..strategy import Candidate, Option, expand, finish, linear_partial, select

aten = torch.ops.aten

Labels = tuple[Hashable | None, ...]


def _ascending(pl: Sequence[Placement], d: int) -> tuple[int, ...]:
    return tuple(j for j, p in enumerate(pl) if p == Shard(d))


def _order_for(pl: Sequence[Placement], labels: Labels, label_order: dict) -> tuple:
    dims = sorted({p.dim for p in pl if p.is_shard()})
    order = []
    for d in dims:
        js = _ascending(pl, d)
        want = label_order.get(labels[d])
        order.append((d, want if want is not None and sorted(want) == list(js) else js))
    return tuple(order)


def label_decision(call: Call, cand: Candidate, labels: dict[int, Labels], out_labels: Labels, *,
                   kernel: Callable[[dict[int, DTensorSpec]], Callable | None] | None = None) -> Decision:
    """:func:`finish` a selected candidate with shard orders that agree across a label.

    ``labels`` gives each constrained tensor's label per dim (``None`` for a broadcast dim);
    ``kernel(targets)`` may return a custom local step given the required input specs.
    """
    label_order: dict[Hashable, tuple[int, ...]] = {}
    for pos, pl in cand.inputs.items():
        s = call.specs[pos]
        if s.placements == tuple(pl):
            for d, js in s.shard_order:
                if len(js) > 1 and labels[pos][d] is not None:
                    label_order.setdefault(labels[pos][d], js)
    meta = call.out_meta
    out_spec = DTensorSpec.build(call.mesh, cand.output, meta.shape, meta.stride(), meta.dtype,
                                 _order_for(cand.output, out_labels, label_order))
    d = finish(call, cand.inputs, out_spec, order=lambda pos, s, pl: _order_for(pl, labels[pos], label_order))
    if kernel is None:
        return d
    return replace(d, kernel=kernel({pos: d.inputs[pos] for pos in cand.inputs}))


def einsum_options(call: Call, operands: Sequence[tuple[int, Labels]], out_labels: Labels,
                   bias: tuple[int, Labels] | None) -> list[list[Option]]:
    """Per-mesh-dim options of a product: replicate, shard a kept or contracted label, keep a partial."""
    per_dim = label_options(call, operands, [(out_labels, [pos for pos, _ in operands])])
    if bias is not None:
        bpos, blabs = bias
        per_dim = [[({**req, bpos: _bias_placement(out, blabs, out_labels)}, out) for req, out in opts]
                   for opts in per_dim]
    return per_dim


def label_options(call: Call, operands: Sequence[tuple[int, Labels]],
                  outputs: Sequence[tuple[Labels, Sequence[int]]], shardable: Sequence[Hashable] | None = None,
                  linear: Sequence[int] | None = None) -> list[list[Option]]:
    """Per-mesh-dim options of a multilinear op given by labels (one output, or several).

    ``outputs`` lists each output's labels and the operands it depends on.  Per mesh dim: all
    replicated; for each label ``L`` (of ``shardable``, or every label), every operand carrying
    ``L`` on ``S(dim of L)``, and each output ``S(dim of L)`` if it carries ``L``, ``P(sum)`` if
    an operand it depends on carries it (summed over), else ``R``; for each operand holding a
    linear partial now (of ``linear``, or every operand), that partial kept, flowing to the
    outputs that depend on it.  One output gives a placement per option, several a tuple of
    placements.
    """
    labels_in: list[Hashable] = []
    for _, labs in operands:
        for L in labs:
            if L not in labels_in and L is not None and (shardable is None or L in shardable):
                labels_in.append(L)
    having = {L: {pos for pos, labs in operands if L in labs} for L in labels_in}

    def outs(fn: Callable[[Labels, Sequence[int]], Placement]) -> Any:
        pls = tuple(fn(olabs, deps) for olabs, deps in outputs)
        return pls[0] if len(pls) == 1 else pls

    per_dim = []
    for j in range(call.mesh.ndim):
        opts: list[Option] = [({}, outs(lambda o, d: Replicate()))]
        for L in labels_in:
            req = {pos: Shard(labs.index(L)) for pos, labs in operands if L in labs}
            opts.append((req, outs(lambda o, d, L=L: Shard(o.index(L)) if L in o else
                                   Partial("sum") if having[L] & set(d) else Replicate())))
        for pos, _ in operands:
            p = call.specs[pos].placements[j]
            if linear_partial(p) and (linear is None or pos in linear):
                opts.append(({pos: p}, outs(lambda o, d, pos=pos, p=p: p if pos in d else Replicate())))
        per_dim.append(opts)
    return per_dim


def _bias_placement(out: Placement, blabs: Labels, out_labels: Labels) -> Placement:
    if out.is_shard():
        L = out_labels[out.dim]
        return Shard(blabs.index(L)) if L in blabs else Replicate()
    return out


def _bias_labels(bias: DTensorSpec, out_shape: Sequence[int], out_labels: Labels) -> Labels:
    """Bias dims aligned to the output from the right; a broadcast dim gets no label."""
    shift = len(out_shape) - bias.ndim
    if shift < 0:
        return (None,) * bias.ndim
    return tuple(out_labels[d + shift] if bias.shape[d] == out_shape[d + shift] else None for d in range(bias.ndim))


SIGNATURES: dict[Any, tuple[tuple[str, str], ...]] = {
    aten.mm.default: (("self", "mk"), ("mat2", "kn")),
    aten.bmm.default: (("self", "bmk"), ("mat2", "bkn")),
    aten.mv.default: (("self", "mk"), ("vec", "k")),
    aten.dot.default: (("self", "k"), ("tensor", "k")),
    aten.addmm.default: (("mat1", "mk"), ("mat2", "kn")),
    aten.baddbmm.default: (("batch1", "bmk"), ("batch2", "bkn")),
    aten.addmv.default: (("mat", "mk"), ("vec", "k")),
}
OUT_LABELS = {aten.mm.default: "mn", aten.bmm.default: "bmn", aten.mv.default: "m", aten.dot.default: "",
              aten.addmm.default: "mn", aten.baddbmm.default: "bmn", aten.addmv.default: "m"}
BIASED = {aten.addmm.default, aten.baddbmm.default, aten.addmv.default}


def product_rule(call: Call) -> Decision:
    """mm / bmm / mv / dot: the einsum candidates, cheapest by modeled cost; addmm / baddbmm /
    addmv: the same with the bias (``self``) following the output."""
    operands = [(call.pos(name), tuple(labs)) for name, labs in SIGNATURES[call.op]]
    out_labels = tuple(OUT_LABELS[call.op])
    bias = None
    labels = dict(operands)
    if call.op in BIASED:
        bpos = call.pos("self")
        blabs = _bias_labels(call.specs[bpos], call.out_meta.shape, out_labels)
        bias = (bpos, blabs)
        labels[bpos] = blabs
    options = einsum_options(call, operands, out_labels, bias)
    cands = expand(options, list(labels))
    broadcast = bias is not None and (len(bias[1]) < len(out_labels) or None in bias[1])
    kernel = (lambda targets, op=call.op: _broadcast_bias(op)) if broadcast else None
    return label_decision(call, select(call, cands), labels, out_labels, kernel=kernel)


for _op, _sig in SIGNATURES.items():  # each operand of the signature (and a bias) must be a DTensor
    register(_op, scalars_by_sign=_op in BIASED,
             needs=tuple(name for name, _ in _sig) + (("self",) if _op in BIASED else ()))(product_rule)


def _broadcast_bias(op: Any) -> Callable:
    """Kernel: the bias expanded to the local product's shape first.  torch's addmv/addmm return
    the bias's own shape when the product is empty (a rank's empty shard), not the broadcast one."""
    def kernel(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        shape = (*a.shape[:-1], b.shape[-1]) if b.ndim >= 2 else tuple(a.shape[:-1])
        return op(bias.expand(shape), a, b, *args, **kwargs)
    return kernel
