"""Indexing ops: flips, rolls, gathers, advanced indexing (the scatters are in ``scatter.py``).

These ops move values around; every Partial kind passes a pure selection, and a pair of
operands that are combined (``self`` and ``src``) may stay Partial together where the op is
linear in them or takes each output element from exactly one of them.  Per mesh dim the
options below are offered; a candidate picks one option per mesh dim (partial kinds of one
tensor must commute) and the engine keeps the cheapest.

| op | options per mesh dim (inputs -> output) |
|---|---|
| ``flip`` | ``S`` on a flipped dim gathered, other ``S`` and every Partial kept |
| ``roll`` | ``S`` on a rolled dim gathered (all dims when ``dims`` is empty: flattened roll), others and every Partial kept |
| ``gather`` | self ``S(d)`` + index ``S(d)`` -> ``S(d)`` for ``d != dim`` of equal size; self R + index ``S(dim)`` -> ``S(dim)``; self P + index R -> P (any kind); R |
| ``index.Tensor`` (integer indices) | self ``S(d)`` on a non-indexed dim -> ``S`` of its output dim (indices R); self R + the only index ``S(k)`` -> ``S`` of the broadcast block's dim ``k``; self P (indices R) -> P; R.  Bool masks: data-dependent shape, raises |
| ``index_put_``, ``_index_put_impl_`` (``index_put`` decomposes into a clone and the latter), integer indices | self ``S(d)`` non-indexed + values ``S`` of the matching dim (R where values broadcast) -> ``S(d)``; self + values jointly P (accumulate: sum/avg; else any plain kind; a plain 0-d values tensor becomes the kind's identity off the first rank) -> P; accumulate with one index: self P(sum) + index ``S(k)`` + values ``S`` -> P(sum); R |
| ``index_put`` with one bool mask | a one-element values: the mask's dims shard self and mask alike; other dims of self kept with values ``S`` of the matching dim (R where values broadcast); partials as above |
| ``nonzero``, ``masked_select`` | data-dependent output shape: raise, asking for ``.full_tensor()`` first |

``index_put_`` shares its rule; ``index_put.default`` (and ``index_copy``, as ``index_put`` with
the index at its dim) is a decomposition the dispatcher runs (``shardtensor/dispatch/decompose.py``):
a clone of self, laid out first as this rule prefers (a sharded or Partial ``values`` keeps its
layout, the replicated clone is sliced or split locally), then ``_index_put_impl_`` into it.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Sequence

import torch

from ...placement import Partial, Placement, Replicate, Shard
from ...spec import DTensorSpec
from ..call import Call, Decision
from ..registry import register
from ..strategy import Candidate, decide, finish

aten = torch.ops.aten

__all__ = ["flip_rule", "roll_rule", "gather_rule", "index_rule", "index_put_rule", "data_dependent_rule"]

R = Replicate()
Opt = tuple[tuple[Placement, ...], Placement]
"""One per-mesh-dim option: placements of each tensor slot, then the output placement."""

_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


# -- shared machinery ------------------------------------------------------------------------

def _norm(dim: int, n: int) -> int:
    n = max(n, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n


def _commuting(pls: Sequence[Placement]) -> bool:
    """Partial kinds on one tensor must commute."""
    parts = [p for p in pls if p.is_partial()]
    if not parts:
        return True
    if any(p.plain_op() is None for p in parts):
        return all(p == parts[0] for p in parts)
    kinds = {p.reduce_op for p in parts}
    return len(kinds) == 1 or kinds <= {"sum", "avg"}


Pair = tuple[int, int, int, int]
"""``(slot a, dim of a, slot b, dim of b)``: where ``a`` shards that dim, ``b`` must shard its dim
over exactly the same mesh dims (so both are cut into the same nested chunks)."""


def _mesh_dims(pl: Sequence[Placement], d: int) -> tuple[int, ...]:
    return tuple(j for j, p in enumerate(pl) if p == Shard(d))


def _aligned(slot_pls: Sequence[Sequence[Placement]], pairs: Sequence[Pair]) -> bool:
    for a, da, b, db in pairs:
        ja = _mesh_dims(slot_pls[a], da)
        if ja and ja != _mesh_dims(slot_pls[b], db):
            return False
    return True


def _candidates(slots: Sequence[int | None], per_dim: Sequence[Sequence[Opt]],
                pairs: Sequence[Pair] = ()) -> list[Candidate]:
    """One candidate per choice of an option on every mesh dim (non-commuting partials and
    misaligned ``pairs`` dropped)."""
    out: list[Candidate] = []
    seen = set()
    for combo in itertools.product(*per_dim):
        output = tuple(o for _, o in combo)
        slot_pls = [tuple(c[0][i] for c in combo) for i in range(len(slots))]
        if pairs and not _aligned(slot_pls, pairs):
            continue
        ins = {pos: slot_pls[i] for i, pos in enumerate(slots) if pos is not None}
        if not _commuting(output) or not all(_commuting(pl) for pl in ins.values()):
            continue
        key = (tuple(sorted(ins.items())), output)
        if key in seen:
            continue
        seen.add(key)
        out.append(Candidate(ins, output))
    return out


def _dedupe(opts: list[Opt]) -> list[Opt]:
    res: list[Opt] = []
    for o in opts:
        if o not in res:
            res.append(o)
    return res


def _partial_kinds(*specs: DTensorSpec | None) -> list[Partial]:
    """Partial placements present on any of ``specs`` (each once, in mesh order)."""
    out: list[Partial] = []
    for s in specs:
        if s is None:
            continue
        for p in s.placements:
            if p.is_partial() and p not in out:
                out.append(p)
    return out


def _constant_term(value: Any, output: Sequence[Placement], mesh) -> Any:
    """This rank's term of a replicated constant under the output's partial kinds.

    sum: the value on the first rank of each sum mesh dim, 0 elsewhere; product: likewise with
    1; avg/max/min: the value everywhere.
    """
    coord = mesh.get_coordinate()
    for j, p in enumerate(output):
        if p.is_partial() and coord[j] != 0:
            if p.reduce_op == "sum":
                return _like(value, 0)
            if p.reduce_op == "product":
                return _like(value, 1)
    return value


def _term_kernel(op: Any, name: str, index: int, output: Sequence[Placement], mesh) -> Callable:
    """``op`` with its constant argument ``name`` (at ``index`` when positional) replaced by
    this rank's term under the output's partial kinds."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if name in kwargs:
            kwargs[name] = _constant_term(kwargs[name], output, mesh)
        else:
            args = args[:index] + (_constant_term(args[index], output, mesh),) + args[index + 1:]
        return op(*args, **kwargs)

    return kernel


def _like(value: Any, c: int) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, c)
    return type(value)(c) if isinstance(value, (bool, int, float, complex)) else c


def _gather_dims(call: Call, pos: int, gather: set[int]) -> Decision:
    """Single-input data movement: ``S`` on ``gather`` dims -> R, everything else (partials too) kept."""
    s = call.specs[pos]
    meta = call.out_meta
    pl = tuple(R if p.is_shard() and p.dim in gather else p for p in s.placements)
    order = tuple((d, js) for d, js in s.shard_order if d not in gather)
    req = s.with_placements(pl, order)
    out = DTensorSpec.build(s.mesh, pl, meta.shape, meta.stride(), meta.dtype, order)
    return finish(call, {pos: req}, out)


def _inplace(op: Any) -> bool:
    """User-facing in-place ops: no option turns their Replicate self Partial.  ``_index_put_impl_``
    is internal (the ``index_put`` decomposition runs it on a fresh clone), so it may."""
    return op._schema.name.endswith("_") and op is not aten._index_put_impl_.default


def _self(call: Call) -> tuple[int, DTensorSpec]:
    """Where ``self`` is, and its spec (a DTensor the rule needs)."""
    return call.pos("self"), call.spec("self")


def _int_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [v] if isinstance(v, int) else list(v)


# -- flip / roll -----------------------------------------------------------------------------

@register(aten.flip.default)
def flip_rule(call: Call) -> Decision:
    """Flipped dims gathered (a shard would have to move to the mirror rank), the rest kept."""
    pos, s = _self(call)
    return _gather_dims(call, pos, {_norm(d, s.ndim) for d in _int_list(call.arg("dims"))})


@register(aten.roll.default)
def roll_rule(call: Call) -> Decision:
    """Rolled dims gathered; ``dims=[]`` rolls the flattened tensor, so everything is gathered."""
    pos, s = _self(call)
    dims = _int_list(call.arg("dims", None))
    gather = {_norm(d, s.ndim) for d in dims} if dims else set(range(s.ndim))
    return _gather_dims(call, pos, gather)


# -- gather ----------------------------------------------------------------------------------

@register(aten.gather.default, needs=("self", "index"))
def gather_rule(call: Call) -> Decision:
    """``out[p] = self[p with dim := index[p]]``: index-shaped, so the output follows the index."""
    sp, s = _self(call)
    ip, ix = call.pos("index"), call.spec("index")
    dim = _norm(call.arg("dim"), s.ndim)
    opts = _index_shaped(dim, s, ix)
    if ix.ndim:
        opts.append(((R, Shard(dim)), Shard(dim)))
    for p in _partial_kinds(s):
        opts.append(((p, R), p))
    per_dim = [_dedupe(_first(opts, (s.placements[j], ix.placements[j]))) for j in range(s.mesh.ndim)]
    pairs = [(0, d, 1, d) for d in range(s.ndim)]
    return decide(call, _candidates([sp, ip], per_dim, pairs))


def _index_shaped(dim: int, s: DTensorSpec, ix: DTensorSpec, *more: DTensorSpec) -> list[Opt]:
    """Per-mesh-dim options of the gather/scatter family: all Replicate, or every operand on
    ``S(d)`` for each dim ``d != dim`` where all their sizes agree (index-shaped ops)."""
    n = 2 + len(more)
    opts: list[Opt] = [((R,) * n, R)]
    for d in range(ix.ndim):
        if d != dim and d < s.ndim and all(t.shape[d] == ix.shape[d] for t in (s, *more)):
            opts.append(((Shard(d),) * n, Shard(d)))
    return opts


def _first(opts: list[Opt], current: tuple[Placement, ...]) -> list[Opt]:
    """The option matching the current placements first (ties prefer following the inputs)."""
    return sorted(opts, key=lambda o: o[0] != current)


# -- advanced indexing -----------------------------------------------------------------------

def _index_slots(call: Call) -> list[tuple[int, int | None, Any]]:
    """``(self dim, flat position, leaf)`` of every non-None index (position None for a plain tensor)."""
    positions = call.positions("indices")
    args, kwargs = call.args_kwargs()
    raw = kwargs.get("indices", args[1] if len(args) > 1 else [])
    out = []
    for d, (leaf, pos) in enumerate(zip(raw, positions)):
        if leaf is not None:
            out.append((d, pos, leaf))
    return out


def _layout(ndim: int, dims: list[int], bnd: int) -> tuple[dict[int, int], int]:
    """Result dims of ``self[indices]``: ``{non-indexed self dim: result dim}`` and where the block of
    ``bnd`` broadcast index dims starts (in place when the indexed dims are adjacent, else first)."""
    rest = [d for d in range(ndim) if d not in dims]
    if dims == list(range(dims[0], dims[-1] + 1)):
        a = dims[0]
        return {d: (d if d < a else d - len(dims) + bnd) for d in rest}, a
    return {d: bnd + i for i, d in enumerate(rest)}, 0


def _index_info(call: Call, s: DTensorSpec) -> tuple[list[tuple[int, int | None, Any]], bool]:
    slots = _index_slots(call)
    if not slots:
        raise call.refuse("with no index tensor")
    masks = False
    for _, pos, leaf in slots:
        dt = call.specs[pos].dtype if pos is not None else getattr(leaf, "dtype", None)
        if dt in (torch.bool, torch.uint8):
            masks = True
        elif dt not in _INDEX_DTYPES:
            raise call.refuse(f"with an index of dtype {dt}")
    return slots, masks


def _bshape(call: Call, slots: list[tuple[int, int | None, Any]]) -> tuple[int, ...]:
    shapes = [tuple(call.specs[pos].shape) if pos is not None else tuple(leaf.shape) for _, pos, leaf in slots]
    return tuple(torch.broadcast_shapes(*shapes))


@register(aten.index.Tensor)
def index_rule(call: Call) -> Decision:
    """``self[indices]``: non-indexed shards kept (renumbered), a single index may be sharded instead."""
    sp, s = _self(call)
    slots, masks = _index_info(call, s)
    if masks:
        raise call.refuse("with a boolean mask has a data-dependent output shape; "
                          "call .full_tensor() first and index the plain tensor")
    dims = [d for d, _, _ in slots]
    bshape = _bshape(call, slots)
    dmap, start = _layout(s.ndim, dims, len(bshape))
    ipos = [pos for _, pos, _ in slots]
    n = 1 + len(ipos)
    rr = (R,) * (n - 1)
    opts: list[Opt] = [((R,) + rr, R)]
    for d, od in dmap.items():
        opts.append(((Shard(d),) + rr, Shard(od)))
    if len(ipos) == 1 and ipos[0] is not None:
        for k in range(len(bshape)):
            opts.append(((R, Shard(k)), Shard(start + k)))
    for p in _partial_kinds(s):
        opts.append(((p,) + rr, p))
    cur = lambda j: (s.placements[j],) + tuple(call.specs[p].placements[j] if p is not None else R for p in ipos)
    per_dim = [_dedupe(_first(opts, cur(j))) for j in range(s.mesh.ndim)]
    return decide(call, _candidates([sp] + ipos, per_dim))


@register(aten.index_put_.default, aten._index_put_impl_.default)
def index_put_rule(call: Call) -> Decision:
    """``self[indices] = values`` (``+=`` with accumulate): non-indexed shards kept with values alike."""
    sp, s = _self(call)
    slots, masks = _index_info(call, s)
    vp = call.pos("values")
    args, kwargs = call.args_kwargs()
    vleaf = kwargs.get("values", args[2] if len(args) > 2 else None)
    if vp is None and isinstance(vleaf, torch.Tensor) and vleaf.ndim > 0:
        raise call.refuse("with a plain (non-DTensor) values tensor")
    v = call.specs[vp] if vp is not None else None
    vshape = tuple(v.shape) if v is not None else tuple(getattr(vleaf, "shape", ()))
    accumulate = bool(call.arg("accumulate", False))
    dims = [d for d, _, _ in slots]
    ipos = [pos for _, pos, _ in slots]
    rr = (R,) * len(ipos)
    opts: list[Opt] = [((R,) + rr + (R,), R)]

    if masks:
        if len(slots) != 1 or ipos[0] is None:
            return decide(call, _candidates([sp] + ipos + [vp], [opts] * s.mesh.ndim), kernel_for=_values_kernel(call, vp))
        a = dims[0]
        m = call.specs[ipos[0]]
        one = math.prod(vshape) == 1
        rnd = s.ndim - m.ndim + 1  # the masked dims become one dim of the selected elements
        for d in range(s.ndim):
            if a <= d < a + m.ndim:
                if one:  # a single value: the mask's dims shard self and mask alike
                    opts.append(((Shard(d), Shard(d - a), R), Shard(d)))
            else:  # the other dims shard self and the values alike
                rd = d if d < a else d - m.ndim + 1
                opts.append(((Shard(d), R, R if one else _values_pl(vshape, rnd, rd, s.shape[d])), Shard(d)))
    else:
        bshape = _bshape(call, slots)
        dmap, start = _layout(s.ndim, dims, len(bshape))
        rnd = s.ndim - len(dims) + len(bshape)
        for d, rd in dmap.items():
            opts.append(((Shard(d),) + rr + (_values_pl(vshape, rnd, rd, s.shape[d]),), Shard(d)))
        if accumulate and len(ipos) == 1 and ipos[0] is not None and not _inplace(call.op):
            ps = Partial("sum")
            for k in range(len(bshape)):
                opts.append(((ps, Shard(k), _values_pl(vshape, rnd, start + k, bshape[k])), ps))
    kinds = ("sum", "avg") if accumulate else ("sum", "avg", "max", "min", "product")
    for p in _partial_kinds(s, v):
        if p.plain_op() in kinds:
            opts.append(((p,) + rr + (p,), p))
    if vp is None:
        opts = [(o[0][:-1] + (R,), o[1]) for o in opts]
    cur = lambda j: ((s.placements[j],) + tuple(call.specs[p].placements[j] if p is not None else R for p in ipos)
                     + ((v.placements[j],) if v is not None else (R,)))
    per_dim = [_dedupe(_first(opts, cur(j))) for j in range(s.mesh.ndim)]
    return decide(call, _candidates([sp] + ipos + [vp], per_dim), kernel_for=_values_kernel(call, vp))


def _values_pl(vshape: tuple[int, ...], rnd: int, rd: int, length: int) -> Placement:
    """Values' placement matching result dim ``rd`` sharded: ``S`` of its aligned dim, R where it broadcasts."""
    vd = rd - (rnd - len(vshape))
    if vd >= 0 and vshape[vd] == length and length != 1:
        return Shard(vd)
    return R


def _values_kernel(call: Call, vp: int | None) -> Callable[[Candidate], Callable | None]:
    """A plain 0-d ``values`` under a Partial output becomes this rank's term of the constant."""
    op, mesh = call.op, call.mesh

    def kernel_for(best: Candidate) -> Callable | None:
        if vp is not None or not any(p.is_partial() for p in best.output):
            return None
        return _term_kernel(op, "values", 2, best.output, mesh)

    return kernel_for


# -- data-dependent shapes -------------------------------------------------------------------

@register(aten.nonzero.default, aten.masked_select.default)
def data_dependent_rule(call: Call) -> Decision:
    """The output length depends on the values: no sharding rule can state it ahead of the kernel."""
    raise call.refuse("has a data-dependent output shape; call .full_tensor() on the "
                      "inputs first and run it on plain tensors")
