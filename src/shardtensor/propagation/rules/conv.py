"""Convolution, pooling and group norm: batch and channel dims shard, spatial dims are gathered.

Convolution is a product over labelled dims (``matrix.label_options``): input ``n c *``,
weight ``o c *`` (transposed: ``c o *``), output ``n o *``, bias ``o``; spatial dims carry no
label and are gathered.  Per mesh dim:

| candidate | input | weight | bias | output |
|---|---|---|---|---|
| replicate | `R` | `R` | `R` | `R` |
| batch | `S(0)` | `R` | `R` | `S(0)` |
| out channels (``groups == 1``) | `R` | `S(o)` | `S(0)` | `S(1)` |
| in channels (``groups == 1``) | `S(1)` | `S(c)` | `P(sum)` (a replicated bias is partitioned) | `P(sum)` |
| a linear partial kept | `P` (as now) | `R` | `P` | `P` |
|  | `R` | `P` (as now) | `P` | `P` |

``convolution_backward`` (grad_output ``n o *``) -> grad_input ``n c *``, grad_weight, grad_bias
``o``, each ``S`` where it carries the sharded label, ``P(sum)`` where the label is summed over
(batch for the weight and bias grads, out channels for the input grad), ``R`` where it does not
depend on it (the bias grad under in-channel sharding); a linear partial grad_output stays
partial in all three.  ``bias_sizes`` becomes the local size.

Pooling (``max_pool{2,3}d_with_indices``, ``avg_pool{2,3}d``, ``_adaptive_avg_pool{2,3}d``,
``adaptive_max_pool{2,3}d`` and their backward): per mesh dim, every dim before the ``s``
spatial ones may shard (each plane is pooled alone; indices are within the plane), spatial dims
are whole; average pools are linear, so ``P(sum)``/``P(avg)`` stay; max pools reduce partials
first, by an all-reduce or a reduce-scatter into a plane dim, whichever the engine prices
cheaper.  Backward: grad_output, self and indices at one placement, a linear partial grad kept
where the others are replicated.

``native_group_norm`` (and backward): the batch dim keeps its shards, the rest is gathered;
mean/rstd (``N, group``) follow the batch; the ``N`` argument becomes the local batch; the
weight and bias grads are ``P(sum)`` where the batch is sharded.

An empty local piece (an uneven split over more ranks than rows or channels) gives zeros of its
local shape: torch's kernels refuse empty channel dims or return the wrong shape for them.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...placement import Partial, Placement, Replicate, Shard
from ..call import Call, Decision
from ..registry import register
from ..strategy import Candidate, Option, decide, expand, linear_partial, replicate, select
from .matrix import label_decision, label_options
from .misc import _ops

aten = torch.ops.aten

N, C, O = "n", "c", "o"


# -- convolution -----------------------------------------------------------------------------

def _conv_labels(call: Call, spatial: int) -> tuple[tuple, tuple, tuple, list[str]]:
    """Input, weight and output labels, and the labels that may shard (channels only when
    ``groups == 1``: a grouped split would have to fall on group boundaries)."""
    sp_x = tuple(("x", i) for i in range(spatial))
    sp_w = tuple(("w", i) for i in range(spatial))
    sp_o = tuple(("y", i) for i in range(spatial))
    w = (C, O) + sp_w if call.arg("transposed") else (O, C) + sp_w
    shardable = [N, C, O] if call.arg("groups") == 1 else [N]
    return (N, C) + sp_x, w, (N, O) + sp_o, shardable


@register(aten.convolution.default, needs=("input", "weight"))
def convolution_rule(call: Call) -> Decision:
    """Batch, out-channel, in-channel (partial) or partial-operand candidates; cheapest wins."""
    xp, wp, bp = call.pos("input"), call.pos("weight"), call.pos("bias")
    if bp is None and call.arg("bias") is not None:
        raise call.refuse("with a plain-tensor bias")
    x, w = call.specs[xp], call.specs[wp]
    if x.ndim != w.ndim:
        raise call.refuse("with an unbatched input")
    xl, wl, ol, shardable = _conv_labels(call, x.ndim - 2)
    operands = [(xp, xl), (wp, wl)]
    options = label_options(call, operands, [(ol, [xp, wp])], shardable)
    labels: dict[int, Any] = {xp: xl, wp: wl}
    if bp is not None:
        options = [[({**req, bp: Shard(0) if out == Shard(1) else
                      out if out.is_partial() else Replicate()}, out) for req, out in opts]
                   for opts in options]
        labels[bp] = (O,)
    cand = select(call, expand(options, list(labels)))
    kernel = _conv_kernel(call.out_meta, bool(call.arg("transposed")), call.arg("groups"))
    return label_decision(call, cand, labels, ol, kernel=lambda targets: kernel)


def _conv_kernel(meta: torch.Tensor, transposed: bool, groups: int) -> Callable:
    """``convolution``, except that an empty input or weight piece gives zeros (plus the bias)."""

    def kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *args: Any) -> torch.Tensor:
        if x.numel() and w.numel():
            return aten.convolution.default(x, w, b, *args)
        out_ch = w.shape[1] * groups if transposed else w.shape[0]
        y = x.new_zeros((x.shape[0], out_ch, *meta.shape[2:]))
        return y if b is None else y + b.reshape(1, -1, *([1] * (y.ndim - 2)))

    return kernel


@register(aten.convolution_backward.default, needs=("grad_output", "input", "weight"))
def convolution_backward_rule(call: Call) -> Decision:
    """The three gradients from one labelled product; ``bias_sizes`` made local."""
    gp, xp, wp = call.pos("grad_output"), call.pos("input"), call.pos("weight")
    x = call.specs[xp]
    xl, wl, ol, shardable = _conv_labels(call, x.ndim - 2)
    operands = [(gp, ol), (xp, xl), (wp, wl)]
    outputs = [(xl, [gp, wp]), (wl, [gp, xp]), ((O,), [gp])]
    options = label_options(call, operands, outputs, shardable)
    return decide(call, expand(options, [gp, xp, wp]),
                  kernel=_conv_backward_kernel(bool(call.arg("transposed")), call.arg("groups")))


def _conv_backward_kernel(transposed: bool, groups: int) -> Callable:
    """``convolution_backward`` with ``bias_sizes`` the local out channels.  An empty input or
    weight piece is computed here: the input and weight grads are zeros of their shapes, the bias
    grad is grad_output summed over every dim but channels (torch's kernel refuses no out
    channels, and returns a zero bias grad for no in channels)."""

    def kernel(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias_sizes: Any, *args: Any) -> Any:
        out_ch = w.shape[1] * groups if transposed else w.shape[0]
        if x.numel() and w.numel():
            return aten.convolution_backward.default(g, x, w, None if bias_sizes is None else [out_ch], *args)
        mask = args[-1]
        return (torch.zeros_like(x) if mask[0] else None, torch.zeros_like(w) if mask[1] else None,
                g.sum([d for d in range(g.ndim) if d != 1]) if mask[2] else None)

    return kernel


# -- pooling ----------------------------------------------------------------------------------

POOLS = {  # op name -> (spatial dims, linear)
    "max_pool2d_with_indices": (2, False), "max_pool3d_with_indices": (3, False),
    "avg_pool2d": (2, True), "avg_pool3d": (3, True),
    "_adaptive_avg_pool2d": (2, True), "_adaptive_avg_pool3d": (3, True),
    "adaptive_max_pool2d": (2, False), "adaptive_max_pool3d": (3, False),
}


def _pool_options(call: Call, positions: list[int], lead: int, linear: int | None,
                  n_out: int) -> list[list[Option]]:
    """Per mesh dim: every tensor ``R``, or every one ``S(d)`` on a leading dim ``d``, or the
    tensor at ``linear`` keeping its linear partial (the others ``R``).  A Partial input that
    must be reduced may so be reduce-scattered into a plane dim, not only all-reduced.  With
    ``n_out`` outputs, the second (max pools' indices) is ``R`` where the first is Partial."""

    def out(pl: Placement) -> Any:
        return (pl, Replicate() if pl.is_partial() else pl) if n_out else pl

    per_dim = []
    for j in range(call.mesh.ndim):
        opts: list[Option] = [({}, out(Replicate()))]
        opts += [(dict.fromkeys(positions, Shard(d)), out(Shard(d))) for d in range(lead)]
        p = None if linear is None else call.specs[linear].placements[j]
        if p is not None and linear_partial(p):
            opts.append(({linear: p}, out(p)))
        per_dim.append(opts)
    return per_dim


@register(*_ops(list(POOLS)))
def pool_rule(call: Call) -> Decision:
    """Each plane pooled alone: leading dims may shard, spatial dims are whole."""
    x = call.specs[0]
    spatial, linear = POOLS[call.op._schema.name.split("::")[-1]]
    n_out = len(call.out_meta) if isinstance(call.out_meta, (tuple, list)) else 0
    options = _pool_options(call, [0], x.ndim - spatial, 0 if linear else None, n_out)
    return decide(call, expand(options, [0]), kernel=_empty_pool(call.op, spatial))


@register(*_ops([n + "_backward" for n in POOLS]), needs=("grad_output", "self"))
def pool_backward_rule(call: Call) -> Decision:
    """grad_output, self (and indices) at one placement; a linear partial grad stays partial."""
    gp, xp = call.pos("grad_output"), call.pos("self")
    spatial = POOLS[call.op._schema.name.split("::")[-1][:-len("_backward")]][0]
    positions = list(call.tensor_positions)
    options = _pool_options(call, positions, call.specs[xp].ndim - spatial, gp, 0)
    return decide(call, expand(options, positions), kernel=_empty_pool(call.op, spatial))


def _empty_pool(op: Any, spatial: int) -> Callable:
    """The pooling op, except that an empty plane dim gives zeros of the local output shape
    (torch refuses empty channel dims): the op runs on meta tensors with one plane to find the
    pooled spatial shape."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if all(t.numel() for t in tensors):
            return op(*args, **kwargs)
        meta = op(*[torch.empty((1,) * (a.ndim - spatial) + tuple(a.shape[a.ndim - spatial:]), dtype=a.dtype,
                                device="meta") if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        lead = tuple(tensors[0].shape[:tensors[0].ndim - spatial])

        def zeros(m: torch.Tensor) -> torch.Tensor:
            return tensors[0].new_zeros((*lead, *m.shape[m.ndim - spatial:]), dtype=m.dtype)

        return tuple(zeros(m) for m in meta) if isinstance(meta, (tuple, list)) else zeros(meta)

    return kernel


# -- group norm -------------------------------------------------------------------------------

def _batch_only(pl: tuple[Placement, ...]) -> tuple[Placement, ...]:
    return tuple(p if p == Shard(0) else Replicate() for p in pl)


def _local_n(call: Call) -> Callable[[list], list]:
    """Local args: the ``N`` argument becomes this rank's batch size (the local input's)."""
    xp, where = call.pos("input"), call.slots("N")

    def local_args(flat: list) -> list:
        flat = list(flat)
        flat[where] = flat[xp].shape[0]
        return flat

    return local_args


@register(aten.native_group_norm.default, needs=("input",))
def group_norm_rule(call: Call) -> Decision:
    """Each sample normalised alone: the batch keeps its shards; mean/rstd follow it."""
    xp = call.pos("input")
    batch = _batch_only(call.specs[xp].placements)
    rep = replicate(len(batch))
    inputs = {xp: batch, **{p: rep for p in call.tensor_positions if p != xp}}
    return decide(call, [Candidate(inputs, [batch, batch, batch])], local_args=_local_n(call),
                  kernel=_contiguous(call.op))


@register(aten.native_group_norm_backward.default, needs=("grad_out", "input"))
def group_norm_backward_rule(call: Call) -> Decision:
    """d_input follows the batch; d_weight/d_bias are ``P(sum)`` where the batch is sharded."""
    gp, xp = call.pos("grad_out"), call.pos("input")
    wpos = call.pos("weight")
    cands = []
    for src in (call.specs[xp], call.specs[gp]):
        batch = _batch_only(src.placements)
        rep = replicate(len(batch))
        inputs = {p: (rep if p == wpos else batch) for p in call.tensor_positions}
        summed = tuple(Partial("sum") if p == Shard(0) else Replicate() for p in batch)
        cands.append(Candidate(inputs, [batch, summed, summed]))
    return decide(call, cands, local_args=_local_n(call), kernel=_contiguous(call.op))


def _contiguous(op: Any) -> Callable:
    """The op on contiguous tensors (the CPU group-norm kernels index raw memory; a gathered
    piece may be a strided view)."""

    def kernel(*args: Any) -> Any:
        return op(*[a.contiguous() if isinstance(a, torch.Tensor) else a for a in args])

    return kernel
