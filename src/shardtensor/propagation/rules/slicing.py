"""Select, slice, split and index_select, their backwards and scatters.

Like the other view ops (``view.py``), these move data without combining values.

| op | required | output |
|---|---|---|
| ``select.int`` | as is (a sharded ``dim``: the owning rank broadcasts the row) | ``drop(pi, dim)`` with ``S(dim)`` -> R; ``unbind`` decomposes into it |
| ``slice.Tensor`` (``narrow``) | ``gather(dim)`` unless the slice is the whole dim | same as required |
| ``split_with_sizes`` (``split``, ``chunk``) | ``gather(dim)`` | every output = required |
| ``index_select`` | ``gather(dim)`` on self; index Replicate | same as self's required |
| ``select_backward``, ``slice_backward`` | grad: ``S(dim)`` gathered | ``insert`` / same; ``input_sizes`` -> local sizes; plain Partial kinds pass |
| ``slice_scatter``, ``select_scatter`` | per mesh dim: self's ``S(d)``, ``d != dim``, else src's, else a Partial kind both share, else R | the common target |
| ``diagonal_scatter`` | as the scatters above, with both ``dim1`` and ``dim2`` kept whole (src's last dim, the diagonal, is never sharded) | the common target |

The ``*_copy`` variants share their rules.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Callable

import torch

from ...placement import Placement, Shard, chunk
from ...spec import DTensorSpec
from .. import kernels
from ..call import Call, Decision
from ..registry import register
from ..strategy import Candidate, Pl, decide, finish
from .view import R, follow, local_sizes, norm_dim, plain_partial, spec_of

aten = torch.ops.aten


# -- select / slice / split / index_select -------------------------------------------------

@register(aten.select.int, aten.select_copy.int)
def select_rule(call: Call) -> Decision:
    """Output ``drop(pi, dim)`` (negative dim and index normalised, every partial passes).

    A sharded ``dim`` is not gathered: the rank holding the row selects it and broadcasts it
    over the mesh dims that shard ``dim`` (one row moves instead of the whole dim).
    """
    s = call.specs[0]
    dim = norm_dim(call.arg("dim"), s.ndim)
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
    out_pl = tuple(R if p.is_shard(dim) else Shard(dim_map[p.dim]) if p.is_shard()
                   else p for p in s.placements)
    out_order = tuple(sorted((dim_map[d], js2) for d, js2 in s.shard_order if d != dim))
    out_spec = spec_of(call, call.out_meta, out_pl, out_order)
    kernel = kernels.select_row(mesh, dim, owners, local_index)
    return replace(finish(call, {0: s}, out_spec, kernel=kernel), copies=True)


@register(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_rule(call: Call) -> Decision:
    """A slice that keeps the whole dim is an identity (shards kept); any other gathers ``dim``."""
    s = call.specs[0]
    out = call.out_meta
    if s.ndim == 0:
        raise call.refuse("on a 0-d tensor")
    dim = norm_dim(call.arg("dim", 0), s.ndim)
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
    dim = norm_dim(call.arg("dim", 0), s.ndim)
    return follow(call, 0, {d: d for d in range(s.ndim)}, list(call.out_meta), gather=[dim])


@register(aten.index_select.default)
def index_select_rule(call: Call) -> Decision:
    """Self: ``dim`` gathered, other shards and partials kept; the index is made Replicate."""
    s = call.specs[0]
    dim = norm_dim(call.arg("dim"), s.ndim)
    required, out_pl, order = follow(call, 0, {d: d for d in range(s.ndim)}, None, gather=[dim], decision=False)
    need = {0: required}
    ipos = call.pos("index")
    if ipos is not None:
        idx = call.specs[ipos]
        need[ipos] = idx.with_placements([R] * idx.mesh.ndim)
    return finish(call, need, spec_of(call, call.out_meta, out_pl, order))


# -- backward of select / slice ----------------------------------------------------------------

@register(aten.select_backward.default)
def select_backward_rule(call: Call) -> Decision:
    """Output = grad with the selected dim inserted (R there); ``input_sizes`` become local sizes."""
    g = call.specs[0]
    out = call.out_meta
    dim = norm_dim(call.arg("dim"), out.ndim)
    required, out_pl, order = follow(call, 0, {d: d + (d >= dim) for d in range(g.ndim)}, None,
                                     partial_ok=plain_partial, decision=False)
    out_spec = spec_of(call, out, out_pl, order)
    return finish(call, {0: required}, out_spec, local_args=local_sizes(call, "input_sizes", out_spec))


@register(aten.slice_backward.default)
def slice_backward_rule(call: Call) -> Decision:
    """Output = grad zero-padded along ``dim`` (gathered); ``input_sizes`` become local sizes."""
    g = call.specs[0]
    out = call.out_meta
    dim = norm_dim(call.arg("dim"), out.ndim)
    required, out_pl, order = follow(call, 0, {d: d for d in range(g.ndim)}, None, gather=[dim],
                                     partial_ok=plain_partial, decision=False)
    out_spec = spec_of(call, out, out_pl, order)
    return finish(call, {0: required}, out_spec, local_args=local_sizes(call, "input_sizes", out_spec))


# -- scatters -------------------------------------------------------------------------------------

def _scatter_target(self_spec: DTensorSpec, src_spec: DTensorSpec, cut: set[int], src_to_self: dict[int, int],
                    whole: bool) -> list[Placement]:
    """Per mesh dim: self's shard off the ``cut`` dims (any dim when ``whole``), else src's, else a
    Partial both share, else R."""
    target: list[Placement] = []
    for a, b in zip(self_spec.placements, src_spec.placements):
        if a.is_shard() and (a.dim not in cut or whole):
            target.append(a)
        elif b.is_shard() and b.dim in src_to_self and (src_to_self[b.dim] not in cut or whole):
            target.append(Shard(src_to_self[b.dim]))
        elif a.is_partial() and a == b:
            target.append(a)
        else:
            target.append(R)
    return target


def _scatter_decision(call: Call, cut: set[int], src_to_self: dict[int, int], whole: bool,
                      kernel: Callable | None = None) -> Decision:
    """``_scatter_target``, or, on mesh dims where that gathers a shard or reduces a Partial of
    either operand, a dim both hold sharded instead (``_scatter_options``): the cheapest."""
    sp, rp = call.pos("self"), call.pos("src")
    s, r = call.spec("self"), call.spec("src")
    back = {v: k for k, v in src_to_self.items()}
    cands = [Candidate({sp: t, rp: tuple(Shard(back[p.dim]) if p.is_shard() else p for p in t)}, t)
             for t in _scatter_options(s, r, _scatter_target(s, r, cut, src_to_self, whole),
                                       [d for d in back if whole or d not in cut])]
    return decide(call, cands, kernel=kernel)


def _scatter_options(s: DTensorSpec, r: DTensorSpec, target: list[Placement], dims: list[int]) -> list[Pl]:
    """``target`` first, then per mesh dim where an operand's shard is gathered or its Partial
    reduced, ``S(d)`` for each of ``dims`` instead (a Partial only where an operand is sharded on
    another mesh dim, as elementwise ops choose)."""
    sharded = {j for x in (s, r) for j, p in enumerate(x.placements) if p.is_shard()}
    per_dim = []
    for j, t in enumerate(target):
        have = (s.placements[j], r.placements[j])
        moved = t == R and (any(p.is_shard() for p in have) or
                            (any(p.is_partial() for p in have) and sharded - {j}))
        per_dim.append([t] + ([Shard(d) for d in dims if s.shape[d] >= s.mesh.shape[j] > 1] if moved else []))
    return list(itertools.islice(itertools.product(*per_dim), 64))


@register(aten.slice_scatter.default, needs=("self", "src"))
def slice_scatter_rule(call: Call) -> Decision:
    s = call.spec("self")
    dim = norm_dim(call.arg("dim", 0), s.ndim)
    r = call.spec("src")
    whole = r.shape[dim] == s.shape[dim]
    kernel = None
    if whole:
        op = call.op

        def kernel(x, src, *args, **kwargs):
            return op(x, src, dim, None, None, 1)

    return _scatter_decision(call, {dim}, {d: d for d in range(s.ndim)}, whole, kernel)


@register(aten.select_scatter.default, needs=("self", "src"))
def select_scatter_rule(call: Call) -> Decision:
    s = call.spec("self")
    dim = norm_dim(call.arg("dim"), s.ndim)
    return _scatter_decision(call, {dim}, {d: d + (d >= dim) for d in range(s.ndim - 1)}, False)


@register(aten.diagonal_scatter.default, needs=("self", "src"))
def diagonal_scatter_rule(call: Call) -> Decision:
    """src holds self's other dims in order, then the diagonal: those dims shard alike."""
    s = call.spec("self")
    d1, d2 = norm_dim(call.arg("dim1", 0), s.ndim), norm_dim(call.arg("dim2", 1), s.ndim)
    rest = [d for d in range(s.ndim) if d not in (d1, d2)]
    return _scatter_decision(call, {d1, d2}, dict(enumerate(rest)), False)
