"""Diagonals, triangles, upsampling, data-dependent ops and random ops (linalg: ``linalg.py``).

| op | required input | output |
|---|---|---|
| ``tril``, ``triu`` | anything kept (partials of every kind: zeros are zeros on each rank) | input's placements; with rows or columns sharded the local kernel uses diagonal ``t + r0 - c0`` (``r0``, ``c0`` = this block's global row/column offset) |
| ``diagonal``, ``diagonal_copy`` | ``S(dim1)``/``S(dim2)`` gathered; every partial kept (a selection) | ``S(d)`` renumbered to ``d``'s place among the kept dims (diagonal last) |
| ``diagonal_backward`` | the diagonal dim gathered; every partial kept (zeros elsewhere) | ``S`` renumbered back; ``input_sizes`` become local sizes |
| ``diag`` | all shards gathered; every partial kept | R / the partials |
| ``diag_embed`` | ``S`` on batch dims kept, last dim gathered; every partial kept | batch shards renumbered around ``dim1``/``dim2`` |
| ``upsample_*`` (and ``_backward``) | ``S(0)``, ``S(1)`` kept, spatial dims gathered; ``P(sum)``/``P(avg)`` kept (linear), every kind for nearest forward | input's placements; a backward's ``input_size`` becomes local |
| ``equal`` | same non-partial placements: compared shard by shard, then a min all-reduce; otherwise both gathered to R | a Python bool |
| ``_local_scalar_dense`` (``.item()``) | R | a Python scalar |

Random ops (``rand_like``, ``randn_like``, ``randint_like``, ``uniform_``, ``normal_``,
``exponential_``, ``geometric_``, ``log_normal_``, ``cauchy_``, ``random_``, ``bernoulli_(p)``)
draw the GLOBAL tensor exactly as one device would, from the op's generator, and keep this
rank's block (see ``shardtensor.rng``): with the same seed the value equals the dense call's,
for every placement and mesh, and every rank's generator stays in step.  Outputs take the
input's placements with Partial turned into Replicate; an in-place fill of a Partial tensor
keeps its placements and memory (the value on coordinate 0 of a sum, on every rank of a max).  The dropout family (``bernoulli.p``, ``bernoulli.default``, ``bernoulli_.float``,
``native_dropout``) is in ``rules.nn``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ...placement import Partial, Placement, Replicate, Shard, unpartial
from ...spec import DTensorSpec
from .. import kernels
from ..call import Call, Decision, unflatten_call
from ..registry import register
from ..strategy import any_partial, finish, linear_partial, shard_instead

aten = torch.ops.aten

__all__ = ["triangle_rule", "diagonal_rule", "diagonal_backward_rule", "diag_rule",
           "diag_embed_rule", "upsample_rule", "upsample_backward_rule", "equal_rule", "item_rule",
           "random_like_rule", "random_fill_rule", "bernoulli_rule"]


def _spec_with(s: DTensorSpec, pl: Sequence[Placement]) -> DTensorSpec:
    """``s`` with placements ``pl``, keeping the shard order of the dims that stay sharded."""
    order = tuple((d, tuple(j for j in js if pl[j] == Shard(d))) for d, js in s.shard_order)
    return s.with_placements(pl, tuple((d, js) for d, js in order if js))


def gather_dims(s: DTensorSpec, keep_shard: Callable[[int], bool], keep_partial: Callable[[Partial], bool]) -> DTensorSpec:
    pl: list[Placement] = []
    for p in s.placements:
        if p.is_shard() and not keep_shard(p.dim):
            p = Replicate()
        elif p.is_partial() and not keep_partial(p):
            p = Replicate()
        pl.append(p)
    return _spec_with(s, pl)


def cheapest_gather(call: Call, pos: int, keep_shard: Callable[[int], bool],
                    keep_partial: Callable[[Partial], bool]) -> DTensorSpec:
    """``gather_dims``' spec for argument ``pos``, or, where that gathers or reduces, a kept dim
    sharded instead (``shard_instead``): whichever the engine prices cheapest."""
    s = call.specs[pos]
    base = gather_dims(s, keep_shard, keep_partial)
    pl = shard_instead(call, pos, base.placements, [d for d in range(s.ndim) if keep_shard(d)])
    return base if pl == base.placements else s.with_placements(pl)


def _renumbered(req: DTensorSpec, where: dict[int, int], meta: torch.Tensor) -> DTensorSpec:
    """Output spec: ``S(d)`` of the input becomes ``S(where[d])``, other placements unchanged."""
    pl = [Shard(where[p.dim]) if p.is_shard() else p for p in req.placements]
    order = tuple(sorted((where[d], js) for d, js in req.shard_order))
    return DTensorSpec.build(req.mesh, pl, meta.shape, meta.stride(), meta.dtype, order)


# -- triangles -----------------------------------------------------------------------------

@register(aten.tril.default, aten.triu.default)
def triangle_rule(call: Call) -> Decision:
    """Every placement passes; a row/column-sharded block shifts its diagonal by ``r0 - c0``."""
    s = call.specs[0]
    if s.ndim < 2:
        raise call.refuse("needs at least 2 dims")
    meta = call.out_meta
    out = DTensorSpec.build(s.mesh, s.placements, meta.shape, meta.stride(), meta.dtype, s.shard_order)
    rows, cols = s.ndim - 2, s.ndim - 1
    kernel = None
    if any(p.is_shard() and p.dim in (rows, cols) for p in s.placements):
        op = call.op

        def kernel(x: torch.Tensor, diagonal: int = 0) -> torch.Tensor:
            _, off = s.local_shape_and_offset()
            return op(x, diagonal + off[rows] - off[cols])

    return finish(call, {}, out, kernel=kernel)


# -- diagonals -----------------------------------------------------------------------------

def _diag_dims(ndim: int, dim1: int, dim2: int) -> tuple[int, int]:
    d1, d2 = dim1 % ndim, dim2 % ndim
    if d1 == d2:
        raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
    return d1, d2


@register(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal_rule(call: Call) -> Decision:
    """Kept dims keep their shards (renumbered); the two diagonal dims are gathered."""
    s = call.specs[0]
    d1, d2 = _diag_dims(s.ndim, call.arg("dim1", 0), call.arg("dim2", 1))
    req = cheapest_gather(call, 0, lambda d: d not in (d1, d2), any_partial)
    kept = [d for d in range(s.ndim) if d not in (d1, d2)]
    out = _renumbered(req, {d: i for i, d in enumerate(kept)}, call.out_meta)
    return finish(call, {0: req}, out)


def _size_positions(call: Call, name: str) -> list[int]:
    args, kwargs = unflatten_call(list(range(len(call.flat))), call.treedef)
    for i, a in enumerate(call.op._schema.arguments):
        if a.name == name:
            v = kwargs.get(name, args[i] if i < len(args) else None)
            return list(v) if isinstance(v, (list, tuple)) else []
    return []


def _local_sizes(out: DTensorSpec, positions: list[int]) -> Callable[[list], list]:
    def local_args(flat: list) -> list:
        flat = list(flat)
        for p, n in zip(positions, out.local_shape):
            flat[p] = n
        return flat

    return local_args


@register(aten.diagonal_backward.default)
def diagonal_backward_rule(call: Call) -> Decision:
    """Zeros with the diagonal filled: grad's batch shards map back, its diagonal dim is gathered."""
    g = call.specs[0]
    meta = call.out_meta
    n = meta.ndim
    d1, d2 = _diag_dims(n, call.arg("dim1"), call.arg("dim2"))
    kept = [d for d in range(n) if d not in (d1, d2)]
    req = cheapest_gather(call, 0, lambda d: d < g.ndim - 1, any_partial)
    out = _renumbered(req, {i: d for i, d in enumerate(kept)}, meta)
    return finish(call, {0: req}, out, local_args=_local_sizes(out, _size_positions(call, "input_sizes")))


@register(aten.diag.default)
def diag_rule(call: Call) -> Decision:
    """``diag`` moves values between 1-D and 2-D: shards gathered, partials kept."""
    s = call.specs[0]
    req = gather_dims(s, lambda d: False, any_partial)
    meta = call.out_meta
    out = DTensorSpec.build(s.mesh, req.placements, meta.shape, meta.stride(), meta.dtype)
    return finish(call, {0: req}, out)


@register(aten.diag_embed.default)
def diag_embed_rule(call: Call) -> Decision:
    """Batch shards renumbered around the two new dims; the embedded (last) dim is gathered."""
    s = call.specs[0]
    meta = call.out_meta
    d1, d2 = _diag_dims(meta.ndim, call.arg("dim1", -2), call.arg("dim2", -1))
    kept = [d for d in range(meta.ndim) if d not in (d1, d2)]
    req = cheapest_gather(call, 0, lambda d: d < s.ndim - 1, any_partial)
    out = _renumbered(req, {i: d for i, d in enumerate(kept)}, meta)
    return finish(call, {0: req}, out)


# -- upsampling ----------------------------------------------------------------------------

UPSAMPLE = ["upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
            "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
            "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"]


def _ops(names: list[str], overload: str = "default") -> list[Any]:
    out = []
    for n in names:
        packet = getattr(aten, n, None)
        if packet is not None and overload in packet.overloads():
            out.append(getattr(packet, overload))
    return out


@register(*_ops(UPSAMPLE))
def upsample_rule(call: Call) -> Decision:
    """Batch/channel shards stay; interpolation is linear (nearest is a selection)."""
    s = call.specs[0]
    nearest = "nearest" in call.op._schema.name
    req = cheapest_gather(call, 0, lambda d: d < 2, any_partial if nearest else linear_partial)
    meta = call.out_meta
    out = _renumbered(req, {0: 0, 1: 1}, meta)
    return finish(call, {0: req}, out, kernel=_empty_safe(call.op, out))


@register(*_ops([n + "_backward" for n in UPSAMPLE]))
def upsample_backward_rule(call: Call) -> Decision:
    """Gradient of upsampling: a sum over the output pixels (linear), batch/channel shards kept."""
    g = call.specs[0]
    req = cheapest_gather(call, 0, lambda d: d < 2, linear_partial)
    meta = call.out_meta
    out = _renumbered(req, {0: 0, 1: 1}, meta)
    return finish(call, {0: req}, out, local_args=_local_sizes(out, _size_positions(call, "input_size")),
                  kernel=_empty_safe(call.op, out))


def _empty_safe(op, out: DTensorSpec) -> Callable[..., torch.Tensor]:
    """The op, except that an empty local shard (3 over 4 ranks) gives zeros of the output's
    local shape and dtype (upsampling, FFTs: MKL refuses to plan an empty transform)."""

    def kernel(x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        if x.numel() == 0:
            return x.new_zeros(out.local_shape, dtype=out.dtype)
        return op(x, *args, **kw)

    return kernel


# -- data-dependent ------------------------------------------------------------------------

def _replicate(s: DTensorSpec) -> DTensorSpec:
    return s.with_placements([Replicate()] * s.mesh.ndim)


@register(aten.equal.default, needs=("self", "other"))
def equal_rule(call: Call) -> Decision:
    """``torch.equal``: shard-wise comparison plus a min all-reduce, or both gathered first."""
    a, b = call.spec("self"), call.spec("other")
    if tuple(a.shape) != tuple(b.shape):
        return finish(call, {}, None, kernel=lambda *args, **kw: False)
    if (a.placements == b.placements and a.shard_order == b.shard_order
            and not any(p.is_partial() for p in a.placements)):
        if all(p.is_replicate() for p in a.placements):
            return finish(call, {}, None)
        return finish(call, {}, None, kernel=kernels.equal(a.mesh))
    return finish(call, {0: _replicate(a), 1: _replicate(b)}, None)


@register(aten.is_pinned.default)
def is_pinned_rule(call: Call) -> Decision:
    """``is_pinned``: the local block's answer (every rank's block lives in the same kind of memory)."""
    return finish(call, {}, None)


@register(aten._local_scalar_dense.default)
def item_rule(call: Call) -> Decision:
    """``.item()`` needs the whole value on every rank."""
    s = call.specs[0]
    return finish(call, {0: _replicate(s)}, None)


# -- random --------------------------------------------------------------------------------

def _random_out(s: DTensorSpec, meta: torch.Tensor) -> DTensorSpec:
    return DTensorSpec.build(s.mesh, unpartial(s.placements), meta.shape, meta.stride(), meta.dtype, s.shard_order)


LIKE_FILL = {aten.rand_like.default: "uniform_", aten.randn_like.default: "normal_"}
RANDINT_LIKE = [op for op in (getattr(aten.randint_like, o, None) for o in
                              ("default", "low_dtype", "generator", "low_generator_dtype")) if op is not None]


@register(*LIKE_FILL, *RANDINT_LIKE)
def random_like_rule(call: Call) -> Decision:
    """``rand_like`` & co. are ``empty_like`` plus a fill (as in ATen): the global fill's block."""
    out = _random_out(call.specs[0], call.out_meta)
    return finish(call, {}, out, kernel=kernels.random_like(call.op, out, LIKE_FILL))


RANDOM_FILL = [aten.uniform_.default, aten.normal_.default, aten.exponential_.default, aten.geometric_.default,
               aten.log_normal_.default, aten.cauchy_.default, *[getattr(aten.random_, o) for o in ("default", "from", "to")]]


@register(*RANDOM_FILL)
def random_fill_rule(call: Call) -> Decision:
    """In-place random fills: this rank's block of the fill of the global tensor."""
    s = call.specs[0]  # a Partial self keeps its placements, as terms of the fill's value
    return finish(call, {}, s, kernel=kernels.random_fill(call.op, s))


@register(aten.bernoulli_.Tensor, needs=("self", "p"))
def bernoulli_rule(call: Call) -> Decision:
    """``x.bernoulli_(p)``: ``u < p`` with ``u`` this rank's block of one global uniform draw;
    ``p`` is placed like ``x``.  (``bernoulli.p``, ``bernoulli.default`` and ``bernoulli_.float``
    are the dropout family, in ``rules.nn``.)"""
    s = call.specs[0]
    ppos, ps = call.pos("p"), call.spec("p")
    if tuple(ps.shape) != tuple(s.shape):
        raise call.refuse("with a broadcast probability tensor")

    whole = s.unpartial()
    return finish(call, {ppos: ps.with_placements(whole.placements, whole.shard_order)}, s, kernel=kernels.bernoulli(s))
