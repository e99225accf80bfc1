"""View ops and the size arguments of view-like ops.

Every rule here moves data without combining values, so every Partial kind passes unchanged
unless a row says otherwise.  ``insert``/``drop`` renumber shard dims when a dim is inserted or dropped.

| op | required | output |
|---|---|---|
| ``view``, ``_unsafe_view``, ``reshape`` (``flatten``/``unflatten``) | dims grouped by equal size products; ``S`` on the first dim of a group kept where the chunk rule gives the same flat ranges (prefix of a nested order); an inner dim sharded alone kept (packed); two sharded dims whose first holds one index per shard kept (nested), and the inverse; every other ``S`` gathered | ``S`` on the first output dim of its group, ``StridedShard(out, rows before)`` for a packed one, ``S`` of the second output dim for the inverse of a nested one; local sizes per rank |
| ``expand`` | ``S`` on an expanded length-1 dim gathered | ``S`` shifted by the new leading dims; local sizes per rank |
| ``permute``, ``transpose.int``, ``t`` (``movedim``, ``swapaxes``) | as is | ``S(d)`` -> ``S(new position of d)`` |
| ``squeeze.dims`` (``squeeze``) | ``S`` on a removed dim gathered; only dims of GLOBAL length 1 are removed | ``drop``; the kernel gets the explicit dim list |
| ``unsqueeze`` | as is | ``insert(pi, dim)`` |
| ``cat`` | one common placement per mesh dim, ``S(dim)`` gathered; cheapest of the inputs' own (gathered, with and without partials) and all-R; legacy ``(0,)`` inputs ignored | the common placement |
| ``stack`` | one common placement (same candidates, ``S(dim)`` legal) | ``insert(pi, dim)`` |
| ``as_strided`` | as is for the identity (same size and stride, offset 0) or a replicated tensor; else R (the gathered whole, laid out with the global strides) | as is; R for a gathered whole (a copy: writes into it raise) |

The ``*_copy`` variants of these views share their rules; select, slice and their scatters and
backwards are in ``slicing.py``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ...errors import PropagationError
from ...pieces import with_strides
from ...placement import Placement, Replicate, Shard, ShardOrder, StridedShard, chunk, unpartial
from ...spec import DTensorSpec
from ..call import Call, Decision
from ..registry import register
from ..strategy import Candidate, any_partial, finish, select, shard_instead
from .factory import put_sizes

aten = torch.ops.aten

__all__ = ["view_rule", "view_groups", "exact_prefix"]

R = Replicate()


# -- shared helpers --------------------------------------------------------------------------

def norm_dim(dim: int, n: int) -> int:
    n = max(n, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n


def spec_of(call: Call, meta: torch.Tensor, pl: Sequence[Placement], order: ShardOrder | None) -> DTensorSpec:
    return DTensorSpec.build(call.mesh, pl, meta.shape, meta.stride(), meta.dtype, order)


def plain_partial(p: Placement) -> bool:
    """Zero-filling ops: a 0 is the identity of sum/avg and absorbing for max/min/product terms alike."""
    return p.plain_op() is not None or not p.is_partial()


def follow(call: Call, pos: int, dim_map: dict[int, int], metas: Any, *, gather: Sequence[int] = (),
           partial_ok: Callable[[Placement], bool] = any_partial, local_args: Callable | None = None,
           kernel: Callable | None = None, decision: bool = True) -> Any:
    """Decision for an op whose output dims come from input dims by ``dim_map`` (in -> out).

    ``S(d)`` with ``d`` unmapped or in ``gather`` becomes R first; partials rejected by
    ``partial_ok`` are reduced; where that moves data, a kept dim may be sharded instead
    (``shard_instead``), whichever is cheapest.  ``metas`` is the output meta (or a list of them for ops whose
    outputs all share the placements).  With ``decision=False`` returns ``(required, out_pl,
    out_order)`` for rules that finish the decision themselves.
    """
    s = call.specs[pos]
    gather = set(gather)
    need: list[Placement] = []
    for p in s.placements:
        if p.is_shard() and (p.dim in gather or p.dim not in dim_map):
            p = R
        elif p.is_partial() and not partial_ok(p):
            p = R
        need.append(p)
    order = tuple((d, js) for d, js in s.shard_order if d in dim_map and d not in gather)
    required = s.with_placements(need, order)
    pl = shard_instead(call, pos, need, [d for d in dim_map if d not in gather])
    if pl != required.placements:
        required, need = s.with_placements(pl), list(pl)
    out_pl = tuple(Shard(dim_map[p.dim]) if p.is_shard() else p for p in need)
    out_order = tuple(sorted((dim_map[d], js) for d, js in required.shard_order))
    if not decision:
        return required, out_pl, out_order
    if isinstance(metas, (list, tuple)):
        out = type(metas)(spec_of(call, m, out_pl, out_order) if isinstance(m, torch.Tensor) else None for m in metas)
    else:
        out = spec_of(call, metas, out_pl, out_order)
    return finish(call, {pos: required}, out, local_args=local_args, kernel=kernel)


def local_sizes(call: Call, name: str, out_spec: DTensorSpec) -> Callable[[list], list] | None:
    """Per-rank rewrite of the size argument ``name`` to the output's local shape."""
    if not any(p.is_shard() for p in out_spec.placements):
        return None
    slots = call.slots(name)
    if slots is None:
        raise call.refuse(f"has no size argument {name!r} to make local")

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
    packed = _packed(s, groups, keep, ones)
    chained = _chained(s, groups, keep)
    split = _split(s, b, groups, keep)
    need: list[Placement] = []
    out_pl: list[Placement] = []
    for j, p in enumerate(s.placements):
        if p.is_shard():
            if p.dim in keep and j in keep[p.dim][1]:
                need.append(p)
                out_pl.append(Shard(keep[p.dim][0]))
                continue
            if p.dim in chained and j in chained[p.dim][1]:
                need.append(p)
                out_pl.append(Shard(keep[chained[p.dim][0]][0]))
                continue
            if p.dim in split and j in split[p.dim][1]:
                need.append(p)
                out_pl.append(Shard(split[p.dim][0]))
                continue
            if p.dim in packed and packed[p.dim][1] == j:
                need.append(p)
                out_pl.append(StridedShard(packed[p.dim][0], packed[p.dim][2]))
                continue
            p = R
        need.append(p)
        out_pl.append(p)
    kept = [(d, js + (split[d][1] if d in split else ())) for d, (_, js) in keep.items()]
    kept += [(d, (j,)) for d, (_, j, _) in packed.items()] + [(d1, js1) for d1, (_, js1) in chained.items()]
    required = s.with_placements(need, tuple(sorted(kept)))
    out_order = dict(keep)
    for d1, (d0, js1) in chained.items():
        out_order[d0] = (keep[d0][0], keep[d0][1] + js1)
    out_spec = spec_of(call, out, out_pl, tuple(sorted([*out_order.values(), *split.values()])))
    copy = call.op is aten.view_copy.default
    if any(p.tensor_dim() is not None for p in out_spec.placements):
        kernel = _local_reshape(out_spec, copy)
    else:
        kernel = _reshape_copy if copy else _reshape
    return finish(call, {0: required}, out_spec, kernel=kernel)


def _chained(s: DTensorSpec, groups: list[tuple[list[int], list[int]]], keep: dict
             ) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Flattens of two sharded dims that stay one nested shard: ``{second dim: (first dim, its
    mesh dims)}``.  Where the first dim's shards hold one index each (``(2, 2, h)`` on a (2, 2)
    mesh as ``(Shard(0), Shard(1))``), each rank's rows of ``(a * b, h)`` are one range: the
    second dim's shard nests under the first's (a batched matmul's fold moves nothing)."""
    a, order = tuple(s.shape), dict(s.shard_order)
    out: dict[int, tuple[int, tuple[int, ...]]] = {}
    for gi, go in groups:
        if len(go) != 1 or len(gi) < 2 or gi[0] not in keep or gi[1] not in order:
            continue
        d0, d1 = gi[0], gi[1]
        js0, js1 = tuple(order[d0]), tuple(order[d1])
        if keep[d0][1] != js0 or math.prod(s.mesh.shape[j] for j in js0) != a[d0]:
            continue
        if any(e in order for e in gi[2:]):
            continue
        r = math.prod(a[e] for e in gi[2:])
        if exact_prefix(a[d1], r, a[d1] * r, 1, [s.mesh.shape[j] for j in js1]) == len(js1):
            out[d1] = (d0, js1)
    return out


def _split(s: DTensorSpec, b: Sequence[int], groups: list[tuple[list[int], list[int]]], keep: dict
           ) -> dict[int, tuple[int, tuple[int, ...]]]:
    """The inverse of :func:`_chained`: a dim nested-sharded so that its first shards hold one
    index of the first output dim each, unflattened: the rest shard the second output dim
    (``{input dim: (second output dim, its mesh dims)}``)."""
    order = dict(s.shard_order)
    out: dict[int, tuple[int, tuple[int, ...]]] = {}
    for gi, go in groups:
        d = gi[0]
        if len(gi) != 1 or len(go) < 2 or d not in keep or keep[d][0] != go[0]:
            continue
        n, js = len(keep[d][1]), tuple(order[d])
        if n == len(js) or math.prod(s.mesh.shape[j] for j in js[:n]) != b[go[0]]:
            continue
        r = math.prod(b[e] for e in go[2:])
        if exact_prefix(b[go[1]] * r, 1, b[go[1]], r, [s.mesh.shape[j] for j in js[n:]]) == len(js) - n:
            out[d] = (go[1], js[n:])
    return out


def _packed(s: DTensorSpec, groups: list[tuple[list[int], list[int]]], keep: dict, ones: dict
            ) -> dict[int, tuple[int, int, int]]:
    """Shards a flatten keeps as a packed shard: ``{input dim: (output dim, mesh dim, split
    factor)}``.  Flattening ``(a, b)`` with ``b`` sharded gives each rank its piece of every one
    of the ``a`` rows: ``StridedShard(out, a)``, no communication, where the dim is the only one
    of its group sharded (by one mesh dim) and each piece keeps its flat range within a row."""
    a = tuple(s.shape)
    out: dict[int, tuple[int, int, int]] = {}
    for d, js in s.shard_order:
        if d in keep or d in ones or len(js) != 1:
            continue
        grp = next(((gi, go) for gi, go in groups if d in gi), None)
        if grp is None or len(grp[1]) != 1 or grp[0][0] == d:
            continue
        gi, go = grp
        if any(e != d and any(p == Shard(e) for p in s.placements) for e in gi):
            continue
        at = gi.index(d)
        r_in = math.prod(a[e] for e in gi[at + 1:])
        if exact_prefix(a[d], r_in, a[d] * r_in, 1, [s.mesh.shape[js[0]]]):
            out[d] = (go[0], js[0], math.prod(a[e] for e in gi[:at]))
    return out


def _reshape(x: torch.Tensor, size: Sequence[int], *args: Any, **kwargs: Any) -> torch.Tensor:
    """A view where the local strides allow one, else a copy: a gathered shard need not have the
    strides of the global tensor (the global meta view already checked viewability)."""
    return x.reshape(size)


def _reshape_copy(x: torch.Tensor, size: Sequence[int], *args: Any, **kwargs: Any) -> torch.Tensor:
    return x.reshape(size).clone()


def _local_reshape(out_spec: DTensorSpec, copy: bool) -> Callable[..., torch.Tensor]:
    """The kernel of a reshape with a sharded result: this rank's piece takes its local shape (the
    size argument names the global one).  A kernel, not a rewrite of the flat arguments, so the
    dispatcher's hit path calls it on the arguments as they come."""
    def kernel(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = x.reshape(out_spec.local_shape)
        return out.clone() if copy else out
    return kernel


# -- expand, permutations, (un)squeeze ---------------------------------------------------------

@register(aten.expand.default, aten.expand_copy.default)
def expand_rule(call: Call) -> Decision:
    """Broadcast dims (length 1 -> n) are gathered; every other shard shifts by the new leading dims."""
    s = call.specs[0]
    out = call.out_meta
    shift = out.ndim - s.ndim
    dim_map = {d: d + shift for d in range(s.ndim) if not (s.shape[d] == 1 and out.shape[d + shift] != 1)}
    required, out_pl, order = follow(call, 0, dim_map, out, decision=False)
    out_spec = spec_of(call, out, out_pl, order)
    return finish(call, {0: required}, out_spec, local_args=local_sizes(call, "size", out_spec))


@register(aten.permute.default, aten.permute_copy.default)
def permute_rule(call: Call) -> Decision:
    s = call.specs[0]
    dims = [norm_dim(d, s.ndim) for d in call.arg("dims")]
    return follow(call, 0, {d: i for i, d in enumerate(dims)}, call.out_meta)


@register(aten.transpose.int, aten.transpose_copy.int)
def transpose_rule(call: Call) -> Decision:
    s = call.specs[0]
    if s.ndim == 0:
        return follow(call, 0, {}, call.out_meta)
    d0, d1 = norm_dim(call.arg("dim0"), s.ndim), norm_dim(call.arg("dim1"), s.ndim)
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
    gone = sorted({norm_dim(d, s.ndim) for d in dims if s.ndim} & {d for d in range(s.ndim) if s.shape[d] == 1})
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
    dim = norm_dim(call.arg("dim"), s.ndim + 1)
    return follow(call, 0, {d: d + (d >= dim) for d in range(s.ndim)}, call.out_meta)


# -- cat / stack --------------------------------------------------------------------------------

def _common(call: Call, positions: list[int], gather_dim: int | None) -> tuple[Placement, ...]:
    """The cheapest placements shared by every input (modeled cost; all-R always offered)."""
    cands: list[tuple[Placement, ...]] = []
    for i in positions:
        pl = tuple(R if gather_dim is not None and p.is_shard(gather_dim) else p for p in call.specs[i].placements)
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
    """Every input on ``common`` in the default order (the output's), the output on ``out_pl``."""
    return finish(call, {i: common for i in positions}, spec_of(call, call.out_meta, out_pl, None))


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
        raise call.refuse("with a list mixing DTensors and plain tensors")
    legacy = [i for i in all_pos if call.specs[i].ndim == 1 and call.specs[i].shape[0] == 0 and out.ndim != 1]
    positions = [i for i in all_pos if i not in legacy] or all_pos[:1]
    dim = norm_dim(call.arg("dim", 0), out.ndim)
    common = _common(call, positions, dim)
    return _list_decision(call, positions, common, common)


@register(aten.stack.default)
def stack_rule(call: Call) -> Decision:
    """Common placements (``S(dim)`` legal), output ``insert(pi, dim)``; partials pass."""
    positions = call.positions("tensors")
    if not positions or any(p is None for p in positions):
        raise call.refuse("with a list mixing DTensors and plain tensors")
    nd = call.specs[positions[0]].ndim
    dim = norm_dim(call.arg("dim", 0), nd + 1)
    common = _common(call, positions, None)
    out_pl = tuple(Shard(p.dim + (p.dim >= dim)) if p.is_shard() else p for p in common)
    return _list_decision(call, positions, common, out_pl)


# -- as_strided ------------------------------------------------------------------------------

@register(aten.as_strided.default)
def as_strided_rule(call: Call) -> Decision:
    """The identity view (same size and stride, offset 0) on any placements, and any view of a
    replicated tensor (every rank holds the whole tensor).  Any other view of a sharded or
    Partial tensor is taken of the gathered whole, laid out with the global strides: it is a
    copy, so writing into it raises (as for every view that needs other ranks' data)."""
    s = call.specs[0]
    size, stride = list(call.arg("size")), list(call.arg("stride"))
    offset = call.arg("storage_offset", None)
    if all(p.is_replicate() for p in s.placements):
        return finish(call, {}, spec_of(call, call.out_meta, s.placements, None), kernel=_whole_as_strided(call.op, s))
    if size != list(s.shape) or stride != list(s.stride) or offset not in (None, 0):
        whole = s.with_placements([R] * s.mesh.ndim)
        return finish(call, {0: whole}, spec_of(call, call.out_meta, whole.placements, None),
                      kernel=_whole_as_strided(call.op, s, gathered=True))

    def kernel(x, *args, **kwargs):
        return aten.alias.default(x)

    return follow(call, 0, {d: d for d in range(s.ndim)}, call.out_meta, kernel=kernel)


def _whole_as_strided(op: Any, s: DTensorSpec, gathered: bool = False) -> Callable[..., torch.Tensor]:
    """Kernel: ``as_strided`` of the local (whole) tensor, whose strides must be the global ones.
    A ``gathered`` copy is laid out with them first (possible where the global layout is dense)."""

    def kernel(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if gathered:
            x = with_strides(x, tuple(s.shape), tuple(s.stride))
        if tuple(x.stride()) != tuple(s.stride):
            raise PropagationError(f"shardtensor: {op}: the whole tensor's local strides {tuple(x.stride())} "
                                   f"differ from its global strides {tuple(s.stride)}; call .contiguous() first")
        return op(x, *args, **kwargs)

    return kernel
