"""``scaled_dot_product_attention`` on DTensors whose sequence dim is sharded: ring attention.

The sharding rule for attention (``propagation/rules/attention.py``) keeps queries, keys and
values sharded on batch or heads; a sequence shard would be moved to heads by an all-to-all
first, which needs the heads to split over the ranks and collides with tensor parallelism already
sharding them.  Here instead the sequence stays where it is: the mesh dims sharding it run ring
attention (``ring.py``) over their flattened group (one ring through every sequence piece), other mesh dims keep batch or head shards (a Partial is reduced, a shard
of any other dim is replicated), and the output comes back sharded like the queries.

``sequence_attention("heads")`` selects the all-to-all to heads instead; ``"ring"`` (the
default) or ``"gather"`` (every rank receives all keys and values at once).

The sequence's order is the DTensor's own, unless an order was declared for its length and
ranks (``declare_order``) and declared orders are in use (``use_declared_orders``): torch's
load-balanced context parallelism shards its buffers permuted (head-tail) and then wraps the
pieces as sequence-sharded DTensors, whose causal mask is the one of the original order.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..placement import Placement, Replicate, Shard
from ..tensor import DTensor
from .layout import SeqLayout, nested
from .ring import ring_attention

__all__ = ["sequence_attention", "seq_sharded_attention", "declare_order", "use_declared_orders"]

_MODES = ("ring", "gather", "heads")
_state: dict[str, Any] = {"mode": "ring", "declared": False}
_orders: dict[tuple[int, int], SeqLayout] = {}


def sequence_attention(mode: str) -> None:
    """How attention on sequence-sharded DTensors runs: ``"ring"`` (default), ``"gather"`` or
    ``"heads"`` (all-to-all to heads, the sharding rule's way)."""
    if mode not in _MODES:
        raise ValueError(f"sequence_attention: mode must be one of {_MODES}, got {mode!r}")
    _state["mode"] = mode


def declare_order(layout: SeqLayout) -> None:
    """Sequence-sharded DTensors of ``layout``'s length over its ranks hold its pieces end to end."""
    _orders[(layout.length, layout.ranks)] = layout


def use_declared_orders(on: bool) -> None:
    """Whether attention reads declared orders (torch's context-parallel dispatcher switch)."""
    _state["declared"] = bool(on)
    if not on:
        _orders.clear()


def _layout(length: int, sizes: list[int]) -> SeqLayout:
    declared = _orders.get((length, math.prod(sizes))) if _state["declared"] else None
    return declared if declared is not None else nested(length, sizes)


_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _seq_dims_of(q: DTensor) -> tuple[int, ...]:
    """The mesh dims sharding the query's sequence dim (the ring runs over their flattened group)."""
    return tuple(j for j, p in enumerate(q.placements) if p.is_shard(q.ndim - 2))


def seq_sharded_attention(args: tuple, kwargs: dict) -> Any:
    """The attention's result, or ``NotImplemented`` where the ring does not apply (no sequence
    shard, a mask, dropout, plain or 3-D tensors, ``"heads"`` mode)."""
    a = dict(zip(_NAMES, args))
    a.update(kwargs)
    q, k, v = a.get("query"), a.get("key"), a.get("value")
    if not (isinstance(q, DTensor) and isinstance(k, DTensor) and isinstance(v, DTensor)) or q.ndim != 4:
        return NotImplemented
    if a.get("attn_mask") is not None or a.get("dropout_p", 0.0) or q.device_mesh != k.device_mesh:
        return NotImplemented
    seq = _seq_dims_of(q)
    if not seq or k.shape[2] != q.shape[2] or k.device_mesh != v.device_mesh:
        return NotImplemented
    mesh = q.device_mesh
    places = _placements(q, k, seq)
    if _state["mode"] == "heads":
        return _through_heads(q, k, v, seq, places, a)
    ql, kl, vl = (t.redistribute(mesh, places).to_local() for t in (q, k, v))
    layout = _layout(q.shape[2], [mesh.size(j) for j in seq])
    out = ring_attention(ql, kl, vl, mesh=mesh, mesh_dim=seq[0] if len(seq) == 1 else seq, layout=layout, is_causal=bool(a.get("is_causal")),
                         scale=a.get("scale"), enable_gqa=bool(a.get("enable_gqa")), method=_state["mode"])
    shape = (*q.shape[:3], v.shape[3])
    return DTensor.from_local(out, mesh, places, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _through_heads(q: DTensor, k: DTensor, v: DTensor, seq: tuple[int, ...], places: tuple[Placement, ...],
                   a: dict) -> DTensor:
    """All-to-all the sequence's mesh dims to heads, attend, and all-to-all the output back."""
    mesh = q.device_mesh
    heads = tuple(Shard(1) if j in seq else p for j, p in enumerate(places))
    qh, kh, vh = (t.redistribute(mesh, heads) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=bool(a.get("is_causal")), scale=a.get("scale"),
                                         enable_gqa=bool(a.get("enable_gqa")))
    assert isinstance(out, DTensor)
    return out.redistribute(mesh, places)


def _placements(q: DTensor, k: DTensor, seq: tuple[int, ...]) -> tuple[Placement, ...]:
    """Per mesh dim: the sequence shard, a batch shard, a heads shard where every rank's query
    heads read only its own key heads, else Replicate."""
    out: list[Placement] = []
    mesh = q.device_mesh
    head_ranks = 1
    for j, p in enumerate(q.placements):
        if j in seq:
            out.append(Shard(2))
        elif p.is_shard(0):
            out.append(Shard(0))
        elif p.is_shard(1) and (q.shape[1] == k.shape[1] or k.shape[1] % (head_ranks * mesh.size(j)) == 0):
            head_ranks *= mesh.size(j)
            out.append(Shard(1))
        else:
            out.append(Replicate())
    return tuple(out)
