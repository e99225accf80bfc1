"""Scatters: values written into ``self`` at indexed places (``scatter``, ``index_add``,
``index_reduce``, ``put``, ``masked_scatter``).

Like the indexing ops (``indexing.py``, whose machinery these share), they move values without
combining them, except where a reduce combines ``self`` with ``src``: ``self`` and ``src`` may then
stay Partial together only for the kinds the reduce commutes with.  Options per mesh dim:

| op | options per mesh dim (inputs -> output) |
|---|---|
| ``scatter.src``, ``scatter_reduce.two``, ``scatter_add`` | self, index, src all ``S(d)``, ``d != dim``, sizes equal -> ``S(d)``; self + src jointly P of a kind the reduce keeps (src: every kind; sum/mean: sum, avg; prod: product; amax: max; amin: min), index R -> P; scatter_add / scatter_reduce sum with include_self only: self P(sum) + index ``S(dim)`` + src ``S(dim)`` (equal sizes) -> P(sum); R |
| ``scatter.value`` | self + index ``S(d)``, ``d != dim``, equal sizes -> ``S(d)``; self P (plain kinds; the local value becomes the kind's identity off the first rank for sum/product) -> P; R |
| ``index_add`` | self + source ``S(d)``, ``d != dim`` -> ``S(d)`` (index R); self + source jointly P(sum/avg) -> P; self P(sum) + index ``S(0)`` + source ``S(dim)`` -> P(sum); R |
| ``index_reduce`` | self + source ``S(d)``, ``d != dim`` -> ``S(d)`` (index R); self + source jointly P of the kind the reduce commutes with (prod: product; mean, floating only: sum, avg; amax: max; amin: min) -> P; R |
| ``put`` | self + source jointly P (accumulate: sum/avg; else any plain kind) -> P; accumulate, not in place: self P(sum) + index and source ``S(k)`` of equal shapes -> P(sum); R (the flat index crosses every dim) |
| ``masked_scatter`` | self + source jointly P (any plain kind: each element comes from one of them) -> P; R (where a source element lands depends on the mask's running count) |
| ``masked_scatter_backward`` | grad P (any plain kind) -> P; R |

In-place variants (``scatter_``, ``scatter_add_``, ``scatter_reduce_``, ``index_add_``,
``index_reduce_``, ``put_``, ``masked_scatter_``) share the rules, but never turn a Replicate
``self`` Partial.  ``scatter_add.default`` is a decomposition the dispatcher runs
(``shardtensor/dispatch/decompose.py``).
"""
from __future__ import annotations

from typing import Callable

import torch

from ...placement import Partial, Shard
from ..call import Call, Decision
from ..registry import register
from ..strategy import Candidate, decide
from .indexing import (R, Opt, _candidates, _dedupe, _first, _index_shaped, _inplace, _norm, _partial_kinds,
                       _self, _term_kernel)

aten = torch.ops.aten

__all__ = ["scatter_rule", "scatter_value_rule", "index_add_rule", "index_reduce_rule", "put_rule",
           "masked_scatter_rule", "masked_scatter_backward_rule"]

# -- scatter family --------------------------------------------------------------------------

_SCATTER_SRC = (aten.scatter.src, aten.scatter_.src, aten.scatter_reduce.two, aten.scatter_reduce_.two,
                aten.scatter_add_.default)
_REDUCE_KINDS = {"sum": ("sum", "avg"), "mean": ("sum", "avg"), "prod": ("product",), "amax": ("max",),
                 "amin": ("min",)}


def _kept_kinds(reduce: str | None, dtype: torch.dtype) -> tuple[str, ...]:
    """The Partial kinds a reduce of rows commutes with (none for an integer mean: each rank's term
    would be rounded)."""
    if reduce == "mean" and not dtype.is_floating_point:
        return ()
    return _REDUCE_KINDS.get(reduce or "", ())


def _reduce_of(call: Call) -> str | None:
    if call.op in (aten.scatter_reduce.two, aten.scatter_reduce_.two):
        return call.arg("reduce")
    if call.op is aten.scatter_add_.default:
        return "sum"
    return None


@register(*_SCATTER_SRC, needs=("self", "index", "src"))
def scatter_rule(call: Call) -> Decision:
    """Scatter dim gathered on self/index/src; other dims sharded alike where all three sizes agree."""
    sp, s = _self(call)
    ip, rp = call.pos("index"), call.pos("src")
    ix, src = call.specs[ip], call.specs[rp]
    dim = _norm(call.arg("dim"), s.ndim)
    reduce = _reduce_of(call)
    opts = _index_shaped(dim, s, ix, src)
    kinds = _kept_kinds(reduce, s.dtype) if reduce is not None else ("sum", "avg", "max", "min", "product")
    for p in _partial_kinds(s, src):
        if p.plain_op() in kinds:
            opts.append(((p, R, p), p))
    if reduce == "sum" and call.arg("include_self", True) and not _inplace(call.op):
        ps = Partial("sum")
        if ix.ndim and ix.shape[dim] == src.shape[dim]:
            opts.append(((ps, Shard(dim), Shard(dim)), ps))
    per_dim = [_dedupe(_first(opts, (s.placements[j], ix.placements[j], src.placements[j])))
               for j in range(s.mesh.ndim)]
    pairs = [(0, d, 1, d) for d in range(s.ndim)] + [(1, d, 2, d) for d in range(ix.ndim)] + \
        [(2, d, 1, d) for d in range(ix.ndim)]
    return decide(call, _candidates([sp, ip, rp], per_dim, pairs))


@register(aten.scatter.value, aten.scatter_.value, needs=("self", "index"))
def scatter_value_rule(call: Call) -> Decision:
    """Scatter a scalar: self and index sharded alike off ``dim``; a Partial self keeps its kind."""
    sp, s = _self(call)
    ip, ix = call.pos("index"), call.spec("index")
    dim = _norm(call.arg("dim"), s.ndim)
    opts = _index_shaped(dim, s, ix)
    for p in _partial_kinds(s):
        if p.plain_op() is not None:
            opts.append(((p, R), p))
    per_dim = [_dedupe(_first(opts, (s.placements[j], ix.placements[j]))) for j in range(s.mesh.ndim)]
    op, mesh = call.op, call.mesh

    def kernel_for(best: Candidate) -> Callable | None:
        if not any(p.is_partial() for p in best.output):
            return None
        return _term_kernel(op, "value", 3, best.output, mesh)

    pairs = [(0, d, 1, d) for d in range(s.ndim)]
    return decide(call, _candidates([sp, ip], per_dim, pairs), kernel_for=kernel_for)


# -- index_add, index_reduce ----------------------------------------------------------------

@register(aten.index_add.default, aten.index_add_.default, needs=("self", "index", "source"))
def index_add_rule(call: Call) -> Decision:
    """``dim`` gathered on self/source, index R; self + source jointly P(sum|avg); sharded index -> P(sum)."""
    return _index_decision(call, "sum")


@register(aten.index_reduce.default, aten.index_reduce_.default, needs=("self", "index", "source"))
def index_reduce_rule(call: Call) -> Decision:
    """As ``index_add``; the joint Partial is the kind the reduce keeps."""
    return _index_decision(call, call.arg("reduce"))


def _index_decision(call: Call, reduce: str) -> Decision:
    """Options of ``op(self, dim, index, source)`` combining rows by ``reduce``: a dim other than
    ``dim`` sharded on self and source alike, a joint Partial of the kinds the reduce keeps, and
    for a sum each rank adding its index piece's rows into a ``P(sum)`` term."""
    sp, s = _self(call)
    ip, rp = call.pos("index"), call.pos("source")
    ix, src = call.specs[ip], call.specs[rp]
    dim = _norm(call.arg("dim"), s.ndim)
    opts: list[Opt] = [((R, R, R), R)]
    if src.ndim == s.ndim:
        opts += [((Shard(d), R, Shard(d)), Shard(d)) for d in range(s.ndim) if d != dim]
    kinds = _kept_kinds(reduce, s.dtype)
    for p in _partial_kinds(s, src):
        if p.plain_op() in kinds:
            opts.append(((p, R, p), p))
    if reduce == "sum" and ix.ndim == 1 and src.ndim == s.ndim and s.ndim > 0 and not _inplace(call.op):
        ps = Partial("sum")
        opts.append(((ps, Shard(0), Shard(dim)), ps))
    per_dim = [_dedupe(_first(opts, (s.placements[j], ix.placements[j], src.placements[j])))
               for j in range(s.mesh.ndim)]
    return decide(call, _candidates([sp, ip, rp], per_dim, [(0, d, 2, d) for d in range(s.ndim)]))


# -- put, masked_scatter ---------------------------------------------------------------------

@register(aten.put.default, aten.put_.default, needs=("self", "index", "source"))
def put_rule(call: Call) -> Decision:
    """``self.flatten()[index] = source`` (``+=`` with accumulate): partials only, or a sharded index
    whose pieces each rank adds into its own term."""
    sp, s = _self(call)
    ip, rp = call.pos("index"), call.pos("source")
    ix, src = call.specs[ip], call.specs[rp]
    accumulate = bool(call.arg("accumulate", False))
    opts: list[Opt] = [((R, R, R), R)]
    kinds = ("sum", "avg") if accumulate else ("sum", "avg", "max", "min", "product")
    for p in _partial_kinds(s, src):
        if p.plain_op() in kinds:
            opts.append(((p, R, p), p))
    if accumulate and not _inplace(call.op) and tuple(ix.shape) == tuple(src.shape):
        ps = Partial("sum")
        opts += [((ps, Shard(k), Shard(k)), ps) for k in range(ix.ndim)]
    per_dim = [_dedupe(_first(opts, (s.placements[j], ix.placements[j], src.placements[j])))
               for j in range(s.mesh.ndim)]
    return decide(call, _candidates([sp, ip, rp], per_dim, [(1, d, 2, d) for d in range(ix.ndim)]))


@register(aten.masked_scatter.default, aten.masked_scatter_.default, needs=("self", "mask", "source"))
def masked_scatter_rule(call: Call) -> Decision:
    """Each output element is self's or one source element: self + source jointly Partial, mask R."""
    sp, s = _self(call)
    mp, rp = call.pos("mask"), call.pos("source")
    m, src = call.specs[mp], call.specs[rp]
    opts: list[Opt] = [((R, R, R), R)]
    for p in _partial_kinds(s, src):
        if p.plain_op() is not None:
            opts.append(((p, R, p), p))
    per_dim = [_dedupe(_first(opts, (s.placements[j], m.placements[j], src.placements[j])))
               for j in range(s.mesh.ndim)]
    return decide(call, _candidates([sp, mp, rp], per_dim))


@register(aten.masked_scatter_backward.default, needs=("grad_output", "mask"))
def masked_scatter_backward_rule(call: Call) -> Decision:
    """The source's gradient selects grad elements (zeros past the mask's count): a Partial grad stays."""
    gp, mp = call.pos("grad_output"), call.pos("mask")
    g, m = call.specs[gp], call.specs[mp]
    opts: list[Opt] = [((R, R), R)]
    opts += [((p, R), p) for p in _partial_kinds(g) if p.plain_op() is not None]
    per_dim = [_dedupe(_first(opts, (g.placements[j], m.placements[j]))) for j in range(g.mesh.ndim)]
    return decide(call, _candidates([gp, mp], per_dim))
