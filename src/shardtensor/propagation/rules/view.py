"""View ops and the size arguments of view-like ops.

Every rule here moves data without combining values, so every Partial kind passes unchanged
unless a row says otherwise.  ``insert``/``drop`` renumber shard dims when a dim is inserted or dropped.

| op | required | output |
|---|---|---|
| ``view``, ``_unsafe_view``, ``reshape`` (``flatten``/``unflatten``) | dims grouped by equal size products; ``S`` on the first dim of a group kept where the chunk rule gives the same flat ranges (prefix of a nested order), every other ``S`` gathered | ``S`` on the first output dim of its group; local sizes per rank |
| ``expand`` | ``S`` on an expanded length-1 dim gathered | ``S`` shifted by the new leading dims; local sizes per rank |
| ``permute``, ``transpose.int``, ``t`` (``movedim``, ``swapaxes``) | as is | ``S(d)`` -> ``S(new position of d)`` |
| ``squeeze.dims`` (``squeeze``) | ``S`` on a removed dim gathered; only dims of GLOBAL length 1 are removed | ``drop``; the kernel gets the explicit dim list |
| ``unsqueeze`` | as is | ``insert(pi, dim)`` |
| ``select.int`` | as is (a sharded ``dim``: the owning rank broadcasts the row) | ``drop(pi, dim)`` with ``S(dim)`` -> R; ``unbind`` decomposes into it |
| ``slice.Tensor`` (``narrow``) | ``gather(dim)`` unless the slice is the whole dim | same as required |
| ``split_with_sizes`` (``split``, ``chunk``) | ``gather(dim)`` | every output = required |
| ``index_select`` | ``gather(dim)`` on self; index Replicate | same as self's required |
| ``cat`` | one common placement per mesh dim, ``S(dim)`` gathered; cheapest of the inputs' own (gathered, with and without partials) and all-R; legacy ``(0,)`` inputs ignored | the common placement |
| ``stack`` | one common placement (same candidates, ``S(dim)`` legal) | ``insert(pi, dim)`` |
| ``select_backward``, ``slice_backward`` | grad: ``S(dim)`` gathered | ``insert`` / same; ``input_sizes`` -> local sizes; plain Partial kinds pass |
| ``slice_scatter``, ``select_scatter`` | per mesh dim: self's ``S(d)``, ``d != dim``, else src's, else a Partial kind both share, else R | the common target |
| ``as_strided`` | identity (same size and stride, offset 0) only; anything else raises | as is |

The ``*_copy`` variants of these views share their rules.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from ... import comm
from ...errors import PropagationError
from ...placement import NormPartial, Partial, Placement, Replicate, Shard, ShardOrder, chunk, unpartial
from ...spec import DTensorSpec
from .. import Call, Decision, register, unsupported
from ..strategy import Candidate, select
from .factory import put_sizes

aten = torch.ops.aten

__all__ = ["view_rule", "view_groups", "exact_prefix"]

R = Replicate()


# -- shared helpers --------------------------------------------------------------------------

def _norm(dim: int, n: int) -> int:
    n = max(n, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n


def _spec(call: Call, meta: torch.Tensor, pl: Sequence[Placement], order: ShardOrder | None) -> DTensorSpec:
    return DTensorSpec.build(call.mesh, pl, meta.shape, meta.stride(), meta.dtype, order)


def _decision(call: Call, required: dict[int, DTensorSpec], output: Any,
              local_args: Callable | None = None, kernel: Callable | None = None) -> Decision:
    inputs = tuple(required.get(i) for i in range(len(call.flat)))
    moved = any(r is not None and r != call.specs[i] for i, r in required.items())
    return Decision(inputs, output, moved, local_args, kernel)


def _keep_partial(p: Placement) -> bool:
    return True


def _plain_partial(p: Placement) -> bool:
    """Zero-filling ops: a 0 is the identity of sum/avg and absorbing for max/min/product terms alike."""
    return not isinstance(p, NormPartial)


def follow(call: Call, pos: int, dim_map: dict[int, int], metas: Any, *, gather: Sequence[int] = (),
           partial_ok: Callable[[Placement], bool] = _keep_partial, local_args: Callable | None = None,
           kernel: Callable | None = None, decision: bool = True) -> Any:
    """Decision for an op whose output dims come from input dims by ``dim_map`` (in -> out).

    ``S(d)`` with ``d`` unmapped or in ``gather`` becomes R first; partials rejected by
    ``partial_ok`` are reduced.  ``metas`` is the output meta (or a list of them for ops whose
    outputs all share the placements).  With ``decision=False`` returns ``(required, out_pl,
    out_order)`` for rules that finish the decision themselves.
    """
    s = call.specs[pos]
    gather = set(gather)
    need: list[Placement] = []
    for p in s.placements:
        if isinstance(p, Shard) and (p.dim in gather or p.dim not in dim_map):
            p = R
        elif isinstance(p, Partial) and not partial_ok(p):
            p = R
        need.append(p)
    order = tuple((d, js) for d, js in s.shard_order if d in dim_map and d not in gather)
    required = s.with_placements(need, order)
    out_pl = tuple(Shard(dim_map[p.dim]) if isinstance(p, Shard) else p for p in need)
    out_order = tuple(sorted((dim_map[d], js) for d, js in required.shard_order))
    if not decision:
        return required, out_pl, out_order
    if isinstance(metas, (list, tuple)):
        out = type(metas)(_spec(call, m, out_pl, out_order) if isinstance(m, torch.Tensor) else None for m in metas)
    else:
        out = _spec(call, metas, out_pl, out_order)
    return _decision(call, {pos: required}, out, local_args, kernel)


def _local_sizes(call: Call, name: str, out_spec: DTensorSpec) -> Callable[[list], list] | None:
    """Per-rank rewrite of the size argument ``name`` to the output's local shape."""
    if not any(isinstance(p, Shard) for p in out_spec.placements):
        return None
    slots = call.slots(name)
    if slots is None:
        raise unsupported(call.op, call.specs, f"has no size argument {name!r} to make local")

    def local_args(flat: list) -> list:
        return put_sizes(flat, slots, out_spec.local_shape)

    return local_args


# -- view / reshape --------------------------------------------------------------------------

def view_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Pairs (input dims, output dims) of consecutive non-1 dims with equal size products.

    None when the tensor is empty (sizes then say nothing about which dims correspond).
    """
    if math.prod(a) == 0 or math.prod(a) != math.prod(b):
        return None
    ia = [d for d, n in enumerate(a) if n != 1]
    ob = [d for d, n in enumerate(b) if n != 1]
    groups, i, o = [], 0, 0
    while i < len(ia) and o < len(ob):
        gi, go = [ia[i]], [ob[o]]
        pi, po = a[ia[i]], b[ob[o]]
        i, o = i + 1, o + 1
        while pi != po:
            if pi < po:
                gi.append(ia[i])
                pi *= a[ia[i]]
                i += 1
            else:
                go.append(ob[o])
                po *= b[ob[o]]
                o += 1
        groups.append((gi, go))
    return groups


def exact_prefix(n_in: int, r_in: int, n_out: int, r_out: int, ks: Sequence[int]) -> int:
    """How many leading levels of a nested shard (mesh sizes ``ks``) carry over exactly.

    Input dim of length ``n_in`` with ``r_in`` elements per row, output dim ``n_out`` with
    ``r_out``: a level is exact when every piece covers the same flat element range on both
    sides under the chunk rule.
    """
    pieces = [(0, n_in, 0, n_out)]
    for level, k in enumerate(ks):
        nxt = []
        for off_i, len_i, off_o, len_o in pieces:
            for r in range(k):
                si, oi = chunk(len_i, k, r)
                so, oo = chunk(len_o, k, r)
                if si * r_in != so * r_out:
                    return level
                if si and (off_i + oi) * r_in != (off_o + oo) * r_out:
                    return level
                nxt.append((off_i + oi, si, off_o + oo, so))
        pieces = nxt
    return len(ks)


def _unit_dims(a: Sequence[int], b: Sequence[int]) -> dict[int, int]:
    """Length-1 input dims -> length-1 output dims at the same flat position (same size product
    before them), the i-th of a run to the i-th: such a dim carries its shard through a view."""
    def runs(sizes: Sequence[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for d, n in enumerate(sizes):
            if n == 1:
                out.setdefault(math.prod(sizes[:d]), []).append(d)
        return out
    if math.prod(a) == 0:
        return {}
    rb = runs(b)
    return {d: e for at, ds in runs(a).items() for d, e in zip(ds, rb.get(at, ()))}


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)
def view_rule(call: Call) -> Decision:
    """Shards survive a reshape only where each rank's piece is the same flat range before and after."""
    s = call.specs[0]
    out = call.out_meta
    a, b = tuple(s.shape), tuple(out.shape)
    groups = view_groups(a, b) or []
    mesh = s.mesh
    first = {gi[0]: (gi, go) for gi, go in groups}
    ones = _unit_dims(a, b)
    keep: dict[int, tuple[int, tuple[int, ...]]] = {}
    for d, js in s.shard_order:
        if d in ones:  # a sharded length-1 dim: one rank holds the row, before and after
            keep[d] = (ones[d], tuple(js))
            continue
        if d not in first:
            continue
        gi, go = first[d]
        r_in = math.prod(a[e] for e in gi[1:])
        r_out = math.prod(b[e] for e in go[1:])
        n = exact_prefix(a[d], r_in, b[go[0]], r_out, [mesh.shape[j] for j in js])
        if n:
            keep[d] = (go[0], tuple(js[:n]))
    need: list[Placement] = []
    out_pl: list[Placement] = []
    for j, p in enumerate(s.placements):
        if isinstance(p, Shard):
            if p.dim in keep and j in keep[p.dim][1]:
                need.append(p)
                out_pl.append(Shard(keep[p.dim][0]))
                continue
            p = R
        need.append(p)
        out_pl.append(p)
    required = s.with_placements(need, tuple((d, js) for d, (_, js) in sorted(keep.items())))
    out_spec = _spec(call, out, out_pl, tuple(sorted(keep.values())))
    copy = call.op is aten.view_copy.default
    size_arg = "shape" if call.op is aten.reshape.default else "size"
    return _decision(call, {0: required}, out_spec, _local_sizes(call, size_arg, out_spec),
                     _reshape_copy if copy else _reshape)


def _reshape(x: torch.Tensor, size: Sequence[int], *args: Any, **kwargs: Any) -> torch.Tensor:
    """A view where the local strides allow one, else a copy: a gathered shard need not have the
    strides of the global tensor (the global meta view already checked viewability)."""
    return x.reshape(size)


def _reshape_copy(x: torch.Tensor, size: Sequence[int], *args: Any, **kwargs: Any) -> torch.Tensor:
    return x.reshape(size).clone()


# -- expand, permutations, (un)squeeze ---------------------------------------------------------

@register(aten.expand.default, aten.expand_copy.default)
def expand_rule(call: Call) -> Decision:
    """Broadcast dims (length 1 -> n) are gathered; every other shard shifts by the new leading dims."""
    s = call.specs[0]
    out = call.out_meta
    shift = out.ndim - s.ndim
    dim_map = {d: d + shift for d in range(s.ndim) if not (s.shape[d] == 1 and out.shape[d + shift] != 1)}
    required, out_pl, order = follow(call, 0, dim_map, out, decision=False)
    out_spec = _spec(call, out, out_pl, order)
    return _decision(call, {0: required}, out_spec, _local_sizes(call, "size", out_spec))


@register(aten.permute.default, aten.permute_copy.default)
def permute_rule(call: Call) -> Decision:
    s = call.specs[0]
    dims = [_norm(d, s.ndim) for d in call.arg("dims")]
    return follow(call, 0, {d: i for i, d in enumerate(dims)}, call.out_meta)


@register(aten.transpose.int, aten.transpose_copy.int)
def transpose_rule(call: Call) -> Decision:
    s = call.specs[0]
    if s.ndim == 0:
        return follow(call, 0, {}, call.out_meta)
    d0, d1 = _norm(call.arg("dim0"), s.ndim), _norm(call.arg("dim1"), s.ndim)
    dim_map = {d: d for d in range(s.ndim)}
    dim_map[d0], dim_map[d1] = d1, d0
    return follow(call, 0, dim_map, call.out_meta)


@register(aten.t.default, aten.t_copy.default)
def t_rule(call: Call) -> Decision:
    s = call.specs[0]
    dim_map = {d: d for d in range(s.ndim)}
    if s.ndim == 2:
        dim_map = {0: 1, 1: 0}
    return follow(call, 0, dim_map, call.out_meta)


@register(aten.squeeze.dims, aten.squeeze_copy.dims)
def squeeze_dims_rule(call: Call) -> Decision:
    """Removes only dims of global length 1 (a 7-long dim has local length 1 on some rank)."""
    s = call.specs[0]
    dims = call.arg("dim")
    dims = [dims] if isinstance(dims, int) else list(dims)
    gone = sorted({_norm(d, s.ndim) for d in dims if s.ndim} & {d for d in range(s.ndim) if s.shape[d] == 1})
    dim_map, k = {}, 0
    for d in range(s.ndim):
        if d not in gone:
            dim_map[d] = k
            k += 1
    op = call.op

    def kernel(x, *args, **kwargs):
        return op(x, gone)

    return follow(call, 0, dim_map, call.out_meta, kernel=kernel)


@register(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def unsqueeze_rule(call: Call) -> Decision:
    s = call.specs[0]
    dim = _norm(call.arg("dim"), s.ndim + 1)
    return follow(call, 0, {d: d + (d >= dim) for d in range(s.ndim)}, call.out_meta)


# -- select / slice / split / index_select -------------------------------------------------

@register(aten.select.int, aten.select_copy.int)
def select_rule(call: Call) -> Decision:
    """Output ``drop(pi, dim)`` (negative dim and index normalised, every partial passes).

    A sharded ``dim`` is not gathered: the rank holding the row selects it and broadcasts it
    over the mesh dims that shard ``dim`` (one row moves instead of the whole dim).
    """
    s = call.specs[0]
    dim = _norm(call.arg("dim"), s.ndim)
    dim_map = {d: d - (d > dim) for d in range(s.ndim) if d != dim}
    js = next((js for d, js in s.shard_order if d == dim), ())
    if not js:
        return follow(call, 0, dim_map, call.out_meta)
    n = s.shape[dim]
    index = call.arg("index")
    if not -n <= index < n:
        raise IndexError(f"select(): index {index} out of range for tensor of size {tuple(s.shape)} at dimension {dim}")
    index %= n
    owners: list[tuple[int, int]] = []
    length, offset, mesh = n, 0, s.mesh
    for j in js:
        k = mesh.shape[j]
        c = -(-length // k)
        r = (index - offset) // c
        length, off = chunk(length, k, r)
        offset += off
        owners.append((j, r))
    local_index = index - offset
    out_pl = tuple(R if isinstance(p, Shard) and p.dim == dim else Shard(dim_map[p.dim]) if isinstance(p, Shard)
                   else p for p in s.placements)
    out_order = tuple(sorted((dim_map[d], js2) for d, js2 in s.shard_order if d != dim))
    out_spec = _spec(call, call.out_meta, out_pl, out_order)
    def kernel(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        coord = mesh.get_coordinate()
        shape = list(x.shape)
        del shape[dim]
        if all(coord[j] == r for j, r in owners):
            row = x.select(dim, local_index).contiguous()
        else:
            row = x.new_empty(shape)
        wire = row.to(torch.uint8) if row.dtype == torch.bool else row
        for j, r in reversed(owners):
            wire = comm.broadcast(wire, r, mesh, j)
        return wire.to(torch.bool) if row.dtype == torch.bool else wire

    return replace(_decision(call, {0: s}, out_spec, kernel=kernel), copies=True)


@register(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_rule(call: Call) -> Decision:
    """A slice that keeps the whole dim is an identity (shards kept); any other gathers ``dim``."""
    s = call.specs[0]
    out = call.out_meta
    if s.ndim == 0:
        raise unsupported(call.op, call.specs, "on a 0-d tensor")
    dim = _norm(call.arg("dim", 0), s.ndim)
    identity = {d: d for d in range(s.ndim)}
    if out.shape[dim] == s.shape[dim]:
        op = call.op

        def kernel(x, *args, **kwargs):
            return op(x, dim, None, None, 1)

        return follow(call, 0, identity, out, kernel=kernel)
    return follow(call, 0, identity, out, gather=[dim])


@register(aten.split_with_sizes.default)
def split_with_sizes_rule(call: Call) -> Decision:
    """``gather(dim)``; every output takes the required placements; partials pass."""
    s = call.specs[0]
    dim = _norm(call.arg("dim", 0), s.ndim)
    return follow(call, 0, {d: d for d in range(s.ndim)}, list(call.out_meta), gather=[dim])


@register(aten.index_select.default)
def index_select_rule(call: Call) -> Decision:
    """Self: ``dim`` gathered, other shards and partials kept; the index is made Replicate."""
    s = call.specs[0]
    dim = _norm(call.arg("dim"), s.ndim)
    required, out_pl, order = follow(call, 0, {d: d for d in range(s.ndim)}, None, gather=[dim], decision=False)
    need = {0: required}
    ipos = call.pos("index")
    if ipos is not None:
        idx = call.specs[ipos]
        need[ipos] = idx.with_placements([R] * idx.mesh.ndim)
    return _decision(call, need, _spec(call, call.out_meta, out_pl, order))


# -- backward of select / slice ----------------------------------------------------------------

@register(aten.select_backward.default)
def select_backward_rule(call: Call) -> Decision:
    """Output = grad with the selected dim inserted (R there); ``input_sizes`` become local sizes."""
    g = call.specs[0]
    out = call.out_meta
    dim = _norm(call.arg("dim"), out.ndim)
    required, out_pl, order = follow(call, 0, {d: d + (d >= dim) for d in range(g.ndim)}, None,
                                     partial_ok=_plain_partial, decision=False)
    out_spec = _spec(call, out, out_pl, order)
    return _decision(call, {0: required}, out_spec, _local_sizes(call, "input_sizes", out_spec))


@register(aten.slice_backward.default)
def slice_backward_rule(call: Call) -> Decision:
    """Output = grad zero-padded along ``dim`` (gathered); ``input_sizes`` become local sizes."""
    g = call.specs[0]
    out = call.out_meta
    dim = _norm(call.arg("dim"), out.ndim)
    required, out_pl, order = follow(call, 0, {d: d for d in range(g.ndim)}, None, gather=[dim],
                                     partial_ok=_plain_partial, decision=False)
    out_spec = _spec(call, out, out_pl, order)
    return _decision(call, {0: required}, out_spec, _local_sizes(call, "input_sizes", out_spec))


# -- scatters -------------------------------------------------------------------------------------

def _scatter_target(self_spec: DTensorSpec, src_spec: DTensorSpec, dim: int, src_to_self: dict[int, int],
                    whole: bool) -> list[Placement]:
    target: list[Placement] = []
    for a, b in zip(self_spec.placements, src_spec.placements):
        if isinstance(a, Shard) and (a.dim != dim or whole):
            target.append(a)
        elif isinstance(b, Shard) and b.dim in src_to_self and (src_to_self[b.dim] != dim or whole):
            target.append(Shard(src_to_self[b.dim]))
        elif isinstance(a, Partial) and a == b:
            target.append(a)
        else:
            target.append(R)
    return target


def _scatter_decision(call: Call, dim: int, src_to_self: dict[int, int], whole: bool,
                      kernel: Callable | None = None) -> Decision:
    sp, rp = call.pos("self"), call.pos("src")
    if sp is None or rp is None:
        raise unsupported(call.op, call.specs, "needs DTensors for both self and src")
    s, r = call.specs[sp], call.specs[rp]
    target = _scatter_target(s, r, dim, src_to_self, whole)
    back = {v: k for k, v in src_to_self.items()}
    src_pl = [Shard(back[p.dim]) if isinstance(p, Shard) else p for p in target]
    out_spec = _spec(call, call.out_meta, target, None)
    return _decision(call, {sp: s.with_placements(target), rp: r.with_placements(src_pl)}, out_spec, kernel=kernel)


@register(aten.slice_scatter.default)
def slice_scatter_rule(call: Call) -> Decision:
    s = call.specs[call.pos("self")] if call.pos("self") is not None else None
    if s is None:
        raise unsupported(call.op, call.specs, "needs a DTensor self")
    dim = _norm(call.arg("dim", 0), s.ndim)
    r = call.specs[call.pos("src")] if call.pos("src") is not None else None
    whole = r is not None and r.shape[dim] == s.shape[dim]
    kernel = None
    if whole:
        op = call.op

        def kernel(x, src, *args, **kwargs):
            return op(x, src, dim, None, None, 1)

    return _scatter_decision(call, dim, {d: d for d in range(s.ndim)}, whole, kernel)


@register(aten.select_scatter.default)
def select_scatter_rule(call: Call) -> Decision:
    s = call.specs[call.pos("self")] if call.pos("self") is not None else None
    if s is None:
        raise unsupported(call.op, call.specs, "needs a DTensor self")
    dim = _norm(call.arg("dim"), s.ndim)
    return _scatter_decision(call, dim, {d: d + (d >= dim) for d in range(s.ndim - 1)}, False)


# -- cat / stack --------------------------------------------------------------------------------

def _common(call: Call, positions: list[int], gather_dim: int | None) -> tuple[Placement, ...]:
    """The cheapest placements shared by every input (modeled cost; all-R always offered)."""
    cands: list[tuple[Placement, ...]] = []
    for i in positions:
        pl = tuple(R if isinstance(p, Shard) and p.dim == gather_dim else p for p in call.specs[i].placements)
        for c in (pl, unpartial(pl)):
            if c not in cands:
                cands.append(c)
    allr = (R,) * call.mesh.ndim
    if allr not in cands:
        cands.append(allr)
    best = select(call, [Candidate({i: c for i in positions}, c) for c in cands])
    return tuple(best.output)


def _list_decision(call: Call, positions: list[int], common: tuple[Placement, ...],
                   out_pl: tuple[Placement, ...]) -> Decision:
    required = {}
    for i in positions:
        s = call.specs[i]
        if s.placements != common or not s.is_default_order:
            s = s.with_placements(common)
        required[i] = s
    return _decision(call, required, _spec(call, call.out_meta, out_pl, None))


@register(aten.cat.default)
def cat_rule(call: Call) -> Decision:
    """Common placements over the inputs with ``S(dim)`` gathered; legacy ``(0,)`` inputs are skipped."""
    all_pos = call.positions("tensors")
    for k, i in enumerate(all_pos):
        if i is not None and call.specs[i].ndim == 0:
            raise PropagationError(f"shardtensor: torch.cat: zero-dimensional tensor (at position {k}) cannot be "
                               "concatenated, as in torch; use torch.stack, or unsqueeze it first")
    out = call.out_meta
    if any(p is None for p in all_pos):
        raise unsupported(call.op, call.specs, "with a list mixing DTensors and plain tensors")
    legacy = [i for i in all_pos if call.specs[i].ndim == 1 and call.specs[i].shape[0] == 0 and out.ndim != 1]
    positions = [i for i in all_pos if i not in legacy] or all_pos[:1]
    dim = _norm(call.arg("dim", 0), out.ndim)
    common = _common(call, positions, dim)
    return _list_decision(call, positions, common, common)


@register(aten.stack.default)
def stack_rule(call: Call) -> Decision:
    """Common placements (``S(dim)`` legal), output ``insert(pi, dim)``; partials pass."""
    positions = call.positions("tensors")
    if not positions or any(p is None for p in positions):
        raise unsupported(call.op, call.specs, "with a list mixing DTensors and plain tensors")
    nd = call.specs[positions[0]].ndim
    dim = _norm(call.arg("dim", 0), nd + 1)
    common = _common(call, positions, None)
    out_pl = tuple(Shard(p.dim + (p.dim >= dim)) if isinstance(p, Shard) else p for p in common)
    return _list_decision(call, positions, common, out_pl)


# -- as_strided ------------------------------------------------------------------------------

@register(aten.as_strided.default)
def as_strided_rule(call: Call) -> Decision:
    """Only the identity view (same size and stride, offset 0): strides of a shard are not global ones."""
    s = call.specs[0]
    size, stride = list(call.arg("size")), list(call.arg("stride"))
    offset = call.arg("storage_offset", None)
    if size != list(s.shape) or stride != list(s.stride) or offset not in (None, 0):
        raise unsupported(call.op, call.specs, f"with size {tuple(size)}, stride {tuple(stride)}, offset {offset} "
                                               "(only the identity is supported on a DTensor)")

    def kernel(x, *args, **kwargs):
        return aten.alias.default(x)

    return follow(call, 0, {d: d for d in range(s.ndim)}, call.out_meta, kernel=kernel)
