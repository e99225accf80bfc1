"""Neural-network ops: softmax, nll_loss, layer/RMS norm, top-k/sort, dropout.

Notation: ``unpartial`` turns every Partial into Replicate, ``gather(π, E)``
also replicates shards of the dims in ``E``, ``gather_from(π, a)`` those of every dim ``>= a``,
``drop``/``insert`` renumber shards when a dim disappears/appears.

Rule table (required input placements -> output placements):

- ``_softmax``, ``_log_softmax``, ``_safe_softmax``: ``gather(π, [dim])`` -> the same, or where
  that moves data another dim sharded instead (``shard_instead``; a Partial reduce-scattered).
- ``_softmax_backward_data``, ``_log_softmax_backward_data``: grad and output both at
  ``gather(src, [dim])``, ``src`` the more sharded of the two (ties: grad) -> the same.
- ``nll_loss_forward``, ``nll_loss2d_forward`` (class dim ``c``): self ``I = gather(π_self, [c])``
  or ``insert(unpartial(π_target), c)`` (both offered, the cheapest wins: a replicated self
  with a batch-sharded target is sliced, not gathered), target ``T = drop(I, c)``, weight ``R``.
  none -> loss ``T``, total_weight ``R``; sum -> both ``P(sum)`` on target-sharding mesh dims;
  mean -> custom step (local sum / all-reduced total weight): loss ``P(sum)`` there, total
  weight ``R``.  Exact for uneven batches, class weights and ignored targets.
- ``nll_loss_backward``, ``nll_loss2d_backward``: as the forward; grad_output ``T`` (none) or
  ``R``; total_weight ``R`` for mean -> grad_input ``I``.
- ``native_layer_norm``, ``_fused_rms_norm``: input ``A = gather_from(π, axis)``, weight/bias
  ``R`` -> every output ``A``.
- ``native_layer_norm_backward``, ``_fused_rms_norm_backward``: grad_out, input, mean/rstd at
  ``A`` (from the input's or grad_out's placements, cheapest) -> d_input ``A``; d_weight/d_bias
  ``P(sum)`` on mesh dims where ``A`` shards a batch dim, ``R`` elsewhere (never ``k`` times).
- ``topk``, ``sort``: per mesh dim ``R`` or ``S(d != dim)``, full-mesh expansion, cheapest
  (``gather(π, [dim])`` listed first) -> values and indices alike.
- ``native_dropout``: train ``unpartial(π)`` -> output and mask alike; eval ``π`` -> output
  ``π``, mask ``unpartial(π)``.
- ``bernoulli_.float`` (what CPU ``F.dropout`` emits), ``bernoulli.p``, ``bernoulli.default``:
  self's layout (see the RNG rule).

Partial ``self`` of nll_loss: reduced first, except that ``P(sum)``/``P(avg)`` may stay on a mesh
dim where the target is replicated (the loss is linear in ``self``; the output keeps that kind).

Shapes: ``F.cross_entropy`` arrives as ``_log_softmax`` + ``nll_loss_forward`` (1-D, 2-D) or
``nll_loss2d_forward`` (4-D); inputs of other dimensionality are reshaped by view ops first.
On CPU ``F.rms_norm`` (and ``aten._fused_rms_norm``, CompositeImplicitAutograd there) arrives
decomposed (``pow``, ``mean.dim``, ``add_``, ``rsqrt``, ``mul`` and their backward), so the
pointwise/reduction rules rule it; the ``_fused_rms_norm`` rules serve devices with a fused kernel.

RNG rule (dropout, bernoulli).  As every random op (``shardtensor.rng``): the mask is this rank's
block of the mask one device draws from the same generator state (every rank builds the global
mask transiently), so replicas agree, shards hold their slice, and on CPU ``F.dropout``,
``native_dropout`` and ``bernoulli`` equal dense torch's after the same ``torch.manual_seed``,
for every placement and world size.  Cost: one 16-byte all-reduce per call.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Sequence

import torch

from ...errors import PropagationError
from ...placement import Partial, Placement, Replicate, Shard, unpartial
from ...spec import DTensorSpec, contiguous_stride
from .. import kernels
from ..call import Call, Decision
from ..registry import register
from ..strategy import Candidate, Pl, decide, finish, shard_instead

aten = torch.ops.aten

__all__ = ["unpartial", "gather", "gather_from", "drop", "insert"]


# -- placement transforms --------------------------------------------------------------------

def gather(pl: Sequence[Placement], dims: Sequence[int]) -> Pl:
    """``unpartial``, and shards of ``dims`` -> Replicate."""
    return tuple(Replicate() if p.is_partial() or (p.is_shard() and p.dim in dims) else p for p in pl)


def gather_from(pl: Sequence[Placement], axis: int) -> Pl:
    """``unpartial``, and shards of every dim ``>= axis`` -> Replicate."""
    return tuple(Replicate() if p.is_partial() or (p.is_shard() and p.dim >= axis) else p for p in pl)


def drop(pl: Sequence[Placement], c: int) -> Pl:
    """Dim ``c`` removed: shards of later dims move down by one (no ``S(c)`` allowed)."""
    assert not any(p.is_shard(c) for p in pl)
    return tuple(Shard(p.dim - 1) if p.is_shard() and p.dim > c else p for p in pl)


def insert(pl: Sequence[Placement], c: int) -> Pl:
    """Dim ``c`` inserted: shards of dims ``>= c`` move up by one."""
    return tuple(Shard(p.dim + 1) if p.is_shard() and p.dim >= c else p for p in pl)


def _shards(spec: DTensorSpec, pl: Sequence[Placement]) -> int:
    n = 1
    for j, p in enumerate(pl):
        if p.is_shard():
            n *= spec.mesh.shape[j]
    return n


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0




# -- 4. softmax / log_softmax ---------------------------------------------------------------

@register(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def softmax_rule(call: Call) -> Decision:
    """Softmax dim gathered, partials reduced; shards of other dims survive; where that moves
    data, another dim may be sharded instead (a Partial reduce-scattered into the rows, as the
    loss or product after it keeps them)."""
    x = call.specs[0]
    dim = _dim(call.arg("dim"), x.ndim)
    pl = shard_instead(call, 0, gather(x.placements, [dim]), [d for d in range(x.ndim) if d != dim], alone=True)
    return decide(call, [Candidate({0: pl}, pl)], meta=call.shaped_meta(x.shape))


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default, needs=("grad_output", "output"))
def softmax_backward_rule(call: Call) -> Decision:
    """grad and output both at ``gather(src, [dim])``, src the more sharded of the two."""
    g, o = call.pos("grad_output"), call.pos("output")
    gs, os_ = call.specs[g], call.specs[o]
    dim = _dim(call.arg("dim"), gs.ndim)
    src = os_ if _shards(os_, os_.placements) > _shards(gs, gs.placements) else gs
    pl = gather(src.placements, [dim])
    return decide(call, [Candidate({g: pl, o: pl}, pl)])


# -- 5. nll_loss ----------------------------------------------------------------------------

def _nll_layouts(call: Call, backward: bool = False) -> list[tuple[Pl, Pl, Pl]]:
    """(self, target, self-shaped output) placements: follow self, or follow the target.

    ``P(sum)``/``P(avg)`` of ``self`` stays on a mesh dim where the target is replicated (the
    loss is linear in ``self``).  The backward reads ``self`` only for its shape, so there any
    partial ``self`` stays as it is and ``grad_input`` is ``R``.
    """
    x, t = call.specs[call.pos("self")], call.specs[call.pos("target")]
    c = 1 if x.ndim >= 2 else 0
    m = x.mesh.ndim
    keep = [p.is_partial() and t.placements[j] == Replicate()
            and (backward or p.plain_op() in ("sum", "avg"))
            for j, p in enumerate(x.placements)]

    def layout(i_pl: Pl, t_pl: Pl) -> tuple[Pl, Pl, Pl]:
        out = tuple(Replicate() if keep[j] and backward else i_pl[j] for j in range(m))
        return i_pl, t_pl, out

    i_pl = tuple(x.placements[j] if keep[j] else gather([x.placements[j]], [c])[0] for j in range(m))
    res = [layout(i_pl, drop(unpartial(i_pl), c))]
    if x.ndim >= 2:
        t_pl = unpartial(t.placements)
        i2 = tuple(x.placements[j] if keep[j] else insert([t_pl[j]], c)[0] for j in range(m))
        res.append(layout(i2, t_pl))
    return res


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default, needs=("self", "target"))
def nll_loss_forward_rule(call: Call) -> Decision:
    """Class dim gathered, target follows; mean all-reduces the total weight (exact, uneven ok)."""
    xp, tp, wp = call.pos("self"), call.pos("target"), call.pos("weight")
    reduction = call.arg("reduction")
    rep = (Replicate(),) * call.mesh.ndim
    cands = []
    for i_pl, t_pl, _ in _nll_layouts(call):
        inputs = {xp: i_pl, tp: t_pl}
        if wp is not None:
            inputs[wp] = rep
        kept = [p if p.is_partial() else None for p in i_pl]
        if reduction == 0:
            out = (tuple(k or p for k, p in zip(kept, t_pl)), rep)
        else:
            summed = tuple(Partial("sum") if p.is_shard() else Replicate() for p in t_pl)
            loss = tuple(k or p for k, p in zip(kept, summed))
            out = (loss, summed if reduction == 2 else rep)
        cands.append(Candidate(inputs, out))
    d = decide(call, cands)
    dims = [j for j, p in enumerate(d.inputs[tp].placements) if p.is_shard()]
    if reduction != 1 or not dims:
        return d
    return replace(d, kernel=kernels.nll_mean(call.op, call.mesh, dims))


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default, needs=("grad_output", "self", "target"))
def nll_loss_backward_rule(call: Call) -> Decision:
    """grad_input follows self's required layout; mean needs the global total weight (``R``)."""
    gp, xp, tp = call.pos("grad_output"), call.pos("self"), call.pos("target")
    wp, twp = call.pos("weight"), call.pos("total_weight")
    reduction = call.arg("reduction")
    rep = (Replicate(),) * call.mesh.ndim
    cands = []
    for i_pl, t_pl, out in _nll_layouts(call, backward=True):
        inputs = {xp: i_pl, tp: t_pl, gp: t_pl if reduction == 0 else rep}
        if wp is not None:
            inputs[wp] = rep
        if twp is not None and reduction == 1:
            inputs[twp] = rep
        cands.append(Candidate(inputs, out))
    return replace(decide(call, cands), kernel=_nll_backward_kernel(call.op))


def _nll_backward_kernel(op):
    """torch's CPU kernel allocates grad_input like ``self`` and refuses a non-contiguous one;
    a rank's shard may be non-contiguous where another's is not (size-1 or empty dims), so one
    rank would fail alone.  ``self`` is read only for its shape: pass a contiguous one."""
    def kernel(grad_output, self, target, *args, **kwargs):
        return op(grad_output.contiguous(), self.contiguous(), target, *args, **kwargs)
    return kernel


# -- 6. layer_norm / rms_norm ---------------------------------------------------------------

def _norm_axis(call: Call, x: DTensorSpec) -> int:
    n = len(call.arg("normalized_shape"))
    return x.ndim - n


def _weight_grad_pl(a: Pl, axis: int) -> Pl:
    return tuple(Partial("sum") if p.is_shard() and p.dim < axis else Replicate() for p in a)


@register(aten.native_layer_norm.default, aten._fused_rms_norm.default)
def layer_norm_rule(call: Call) -> Decision:
    """Normalized dims gathered, partials reduced, weight/bias replicated; outputs all ``A``."""
    xp = call.pos("input")
    x = call.specs[xp]
    a = gather_from(x.placements, _norm_axis(call, x))
    rep = (Replicate(),) * x.mesh.ndim
    inputs = {xp: a}
    for name in ("weight", "bias"):
        p = call.pos(name)
        if p is not None:
            inputs[p] = rep
    return decide(call, [Candidate(inputs, [a] * (3 if call.op is aten.native_layer_norm.default else 2))],
                  meta=_norm_meta(call, x, _norm_axis(call, x)))


_LOW = (torch.float16, torch.bfloat16)


def _norm_meta(call: Call, x: DTensorSpec, axis: int) -> tuple[torch.Tensor, ...]:
    """The outputs' metadata as the kernels make it, without running torch's reference on meta
    tensors (hundreds of microseconds): the output like the input, contiguous; the statistics
    with the normalized dims kept as 1, in float32 for half inputs except layer norm's on CPU,
    which keeps the input's dtype (its meta kernel says float32 there too)."""
    layer = call.op is aten.native_layer_norm.default
    stat_shape = tuple(x.shape[:axis]) + (1,) * (x.ndim - axis)
    low = x.dtype in _LOW and not (layer and x.mesh.device_type == "cpu")
    stat = torch.empty_strided(stat_shape, contiguous_stride(stat_shape), dtype=torch.float32 if low else x.dtype,
                               device="meta")
    out = torch.empty_strided(tuple(x.shape), contiguous_stride(x.shape), dtype=x.dtype, device="meta")
    return (out, stat, stat) if layer else (out, stat)


@register(aten.native_layer_norm_backward.default, aten._fused_rms_norm_backward.default, needs=("grad_out", "input"))
def layer_norm_backward_rule(call: Call) -> Decision:
    """d_input ``A``; d_weight/d_bias ``P(sum)`` only where ``A`` shards a batch dim."""
    layer = call.op is aten.native_layer_norm_backward.default
    gp, xp = call.pos("grad_out"), call.pos("input")
    x, g = call.specs[xp], call.specs[gp]
    axis = _norm_axis(call, x)
    mask = list(call.arg("output_mask"))
    stats = [call.pos("mean"), call.pos("rstd")] if layer else [call.pos("rstd")]
    params = [call.pos("weight")] + ([call.pos("bias")] if layer else [])
    names = ["weight", "bias"] if layer else ["weight"]
    for k, name in enumerate(names):
        if mask[k + 1] and call.arg(name) is None:
            raise PropagationError(f"shardtensor: {call.op}: output_mask asks for d_{name} but {name} is None")
    rep = (Replicate(),) * x.mesh.ndim
    cands = []
    for src in (x, g):
        a = gather_from(src.placements, axis)
        inputs = {xp: a, gp: a}
        for s in stats:
            if s is not None:
                inputs[s] = a
        for p in params:
            if p is not None:
                inputs[p] = rep
        wg = _weight_grad_pl(a, axis)
        outs = [a if mask[0] else None] + [wg if mask[k + 1] else None for k in range(len(names))]
        cands.append(Candidate(inputs, outs))
    return decide(call, cands)


# -- 7. topk / sort -------------------------------------------------------------------------

def _expand(x: DTensorSpec, dim: int) -> list[Pl]:
    """``gather(π, [dim])`` first, then every full-mesh choice of ``R`` / ``S(d != dim)``."""
    base = gather(x.placements, [dim])
    opts = [Replicate()] + [Shard(d) for d in range(x.ndim) if d != dim]
    out = [base]
    for combo in itertools.product(opts, repeat=x.mesh.ndim):
        if combo == base:
            continue
        pieces: dict[int, int] = {}
        for j, p in enumerate(combo):
            if p.is_shard():
                pieces[p.dim] = pieces.get(p.dim, 1) * x.mesh.shape[j]
        if all(n <= x.shape[d] for d, n in pieces.items()):
            out.append(tuple(combo))
    return out


@register(aten.topk.default, aten.sort.default, aten.sort.stable)
def topk_sort_rule(call: Call) -> Decision:
    """Values and indices share the input's required layout; ``dim`` is whole (other shards kept,
    or moved where cheaper)."""
    x = call.specs[0]
    if x.ndim == 0:
        pl = unpartial(x.placements)
        return decide(call, [Candidate({0: pl}, [pl, pl])])
    dim = _dim(call.arg("dim", -1), x.ndim)
    return decide(call, [Candidate({0: pl}, [pl, pl]) for pl in _expand(x, dim)])


# -- dropout / bernoulli: the RNG rule --------------------------------------------------------

@register(aten.native_dropout.default)
def native_dropout_rule(call: Call) -> Decision:
    """Train: partials reduced, mask this rank's block of one device's mask; eval: identity
    (partials kept)."""
    x = call.specs[0]
    train = call.arg("train")
    if train is False:
        return decide(call, [Candidate({}, [x.placements, unpartial(x.placements)])])
    pl = unpartial(x.placements)
    want = x.with_placements(pl)

    def kernel(inp, p, train=None):
        q = 1.0 - p
        scale = 0.0 if q == 0 else 1.0 / q
        mask = kernels.global_fill(want, inp, torch.bool, None, lambda full, g: full.bernoulli_(q, generator=g))
        return inp.mul(mask).mul_(scale), mask

    return decide(call, [Candidate({0: pl}, [pl, pl])], kernel=kernel)


@register(aten.bernoulli_.float)
def bernoulli_inplace_rule(call: Call) -> Decision:
    """``self.bernoulli_(p)`` (CPU ``F.dropout``): self keeps its spec and gets its block of one
    device's draw; a Partial self holds it as terms of the value."""
    s = call.specs[0]
    return finish(call, {}, s, kernel=kernels.random_fill(aten.bernoulli_.float, s))


@register(aten.bernoulli.p, aten.bernoulli.default)
def bernoulli_rule(call: Call) -> Decision:
    """Fresh random values with self's layout (``bernoulli.default`` reads probabilities from
    self: ``u < p`` with ``u`` this rank's block of one device's uniforms, as torch's CPU kernel)."""
    s = call.specs[0]
    pl = unpartial(s.placements)
    want = s.with_placements(pl)
    probs = call.op is aten.bernoulli.default

    def kernel(self, *args, generator=None):
        if probs:
            u = kernels.global_fill(want, self, kernels.uniform_dtype(self), generator, lambda full, g: full.uniform_(generator=g))
            return (u < self).to(self.dtype)
        p = args[0] if args else 0.5
        return kernels.global_fill(want, self, self.dtype, generator, lambda full, g: full.bernoulli_(p, generator=g))

    return decide(call, [Candidate({0: pl}, pl)], kernel=kernel)
