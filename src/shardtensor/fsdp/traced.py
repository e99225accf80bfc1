"""A ``fully_shard`` group's all-gather and reduce-scatter as one node of a compiled graph.

Under ``torch.compile`` the hooks (``hooks.py``) call ``gather_group(key, *sharded)``, which
AOTAutograd traces on fake tensors: the padded local shards are concatenated (cast to the
compute dtype), ONE all-gather over dp gives the ``(W, n)`` stack, and each parameter is cut
out of it.  Backward pads each unsharded gradient to ``W`` blocks, concatenates them (cast to
the reduce dtype), and ONE reduce-scatter (average over dp; on HSDP then an all-reduce over
the replicas) gives every sharded gradient.  The same collectives as the eager hooks, with
the buffers, their freeing and prefetching left to the compiler.  The graph gets the group
through a key (a string constant of the graph), since a group is no graph value.
"""
from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .. import comm
from ..compile import in_graph
from ..tensor import DTensor
from .group import ParamGroup
from .packing import Packing
from .param import FSDPParam

__all__ = ["gather_group", "regather_in_backward", "traced_key"]

_GROUPS: "weakref.WeakValueDictionary[str, ParamGroup]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def traced_key(group: ParamGroup) -> str | None:
    """The key ``gather_group`` finds ``group`` by (a group without parameters has nothing to
    gather), or None where the group cannot be traced (parameters on several devices, or of
    several compute dtypes: the eager hooks then run)."""
    devices = {p.padded.device for p in group.params}
    dtypes = {group.compute_dtype(p) for p in group.params}
    if len(devices) > 1 or len(dtypes) > 1:
        return None
    # a string: dynamo would make an int that varies between calls symbolic; a group keeps its key
    # (after nn.Module._apply too), and its graphs' guards on the parameters' dtypes still hold
    key = group.traced_key or f"fsdp group {next(_KEYS)}"
    _GROUPS[key] = group
    return key


def _gather(group: ParamGroup, sharded: tuple) -> tuple:
    """Copy-in, one all-gather over dp, copy-out: the unsharded parameters."""
    info, params = group.info, group.params
    dtype = group.compute_dtype(params[0])
    if info.world == 1:  # one dp rank: copies of its shards (no collective)
        return tuple(_unsharded(p, x._local_tensor.to(dtype, copy=True), dtype) for p, x in zip(params, sharded))
    pk = Packing(params, range(len(params)), lambda i: 1, info.world, info.rank)
    pieces = []
    for i in pk.items:
        p, local = params[i], sharded[i]._local_tensor
        if p.rows < p.c:  # an even parameter's short last block: zeros up to its slot
            local = torch.cat([local, local.new_zeros((p.c - p.rows, *p.rest))])
        pieces.append(local.reshape(-1).to(dtype))
    short = pk.total - sum(pk.sizes)
    stack = comm.all_gather(torch.cat(pieces + [pieces[0].new_zeros(short)] if short else pieces),
                            info.mesh, info.dp_dim)  # (W, total)
    outs: list[Any] = [None] * len(params)
    for i, at, n in zip(pk.items[:pk.n_even], pk.starts, pk.even_sizes):
        p = params[i]
        outs[i] = stack[:, at: at + n].reshape(info.world * p.c, *p.rest)[: p.unsharded_shape[0]]
    for j, i in enumerate(pk.items[pk.n_even:]):
        outs[i] = torch.cat(pk.gathered(stack, j)).reshape(params[i].unsharded_shape)
    return tuple(_unsharded(p, full, dtype) for p, full in zip(params, outs))


def _unsharded(p: FSDPParam, full: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The unsharded parameter from its dp-gathered local tensor (a DTensor on tp for 2-D).  A
    new tensor, never a view of the shard: the root's hooks are a graph of their own, and an
    output of it that aliases an input turned on the shard's ``requires_grad`` (a recompile)."""
    return full if p.tp_spec is None else DTensor(full, p.tp_spec.with_dtype(dtype))


def _reduce(group: ParamGroup, grads: tuple) -> tuple:
    """The sharded gradients (average over dp) of the unsharded ``grads``: one reduce-scatter."""
    info, params = group.info, group.params
    if all(g is None for g in grads):
        return (None,) * len(params)
    local = [None if g is None else ParamGroup._local_grad(p, g) for p, g in zip(params, grads)]
    dtype = group.reduce_dtype or next(g.dtype for g in local if g is not None)
    if info.world == 1 and info.rep_dim is None and group.divide_factor in (None, 1.0):  # one rank: its gradients
        return tuple(None if g is None else DTensor(g.to(dtype).to(p.orig_dtype), p.spec) for p, g in zip(params, local))
    pk = Packing(params, range(len(params)), lambda i: 1, info.world, info.rank)
    full = [torch.zeros(p.unsharded_shape, dtype=dtype, device=p.padded.device) if g is None else g.to(dtype)
            for p, g in zip(params, local)]
    cols = []
    for i in pk.items[:pk.n_even]:
        p, g = params[i], full[i]
        if g.shape[0] < info.world * p.c:
            g = torch.cat([g, g.new_zeros((info.world * p.c - g.shape[0], *p.rest))])
        cols.append(g.reshape(info.world, p.padded_numel))
    if pk.runs:  # rank q's block: its pieces of the ragged parameters end to end, zeros up to the longest
        ragged = [full[i] for i in pk.items[pk.n_even:]]
        cols.append(torch.stack([torch.cat(pk.rank_parts(q, ragged) + [ragged[0].new_zeros(pk.total - pk.ends[q])])
                                 for q in range(info.world)]))
    red = group._average(torch.cat(cols, dim=1), ())  # (n,); never None: hooks.py traces no deferred all-reduce
    assert red is not None
    out: list[Any] = [None] * len(params)
    for i, at in zip(pk.items, pk.starts):
        p = params[i]
        piece = red[at: at + p.rows * p.row_numel].reshape(p.rows, *p.rest)
        out[i] = None if local[i] is None else DTensor(piece.to(p.orig_dtype), p.spec)
    return tuple(out)


class _GatherGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, key: str, *sharded: torch.Tensor) -> Any:
        ctx.key = key
        ctx.set_materialize_grads(False)
        return _gather(_GROUPS[key], sharded)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return (None, *_reduce(_GROUPS[ctx.key], grads))


@in_graph
def gather_group(key: str, *sharded: torch.Tensor) -> tuple:
    """The unsharded parameters of the group ``key`` (``traced_key``) from its sharded ones: a
    plain tensor each, or a DTensor on the tp mesh for a 2-D layout.  One node of a graph."""
    return _GatherGroup.apply(key, *sharded)


def _recompute(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    return CheckpointPolicy.MUST_RECOMPUTE


regather_in_backward = functools.partial(create_selective_checkpoint_contexts, _recompute)
"""``checkpoint``'s ``context_fn`` for a group's gather: every op of it is run again in backward,
so the graph keeps the sharded parameters, not the unsharded ones (``reshard_after_forward``)."""
