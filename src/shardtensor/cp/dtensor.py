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
from ..spec import contiguous_stride
from ..tensor import DTensor
from .layout import SeqLayout, nested
from .ring import ring_attention

__all__ = ["sequence_attention", "seq_sharded_attention", "declare_order", "use_declared_orders", "rotate_method"]

_MODES = ("ring", "gather", "heads", "hybrid")
_state: dict[str, Any] = {"mode": "ring", "declared": False}
_orders: dict[tuple[int, int], SeqLayout] = {}


def sequence_attention(mode: str) -> None:
    """How attention on sequence-sharded DTensors runs: ``"ring"`` (default), ``"gather"``,
    ``"heads"`` (all-to-all to heads) or ``"hybrid"`` (heads on the outer of two sequence mesh
    dims, a ring on the inner).  ``context_parallel``'s ``set_rotate_method`` sets ring or gather."""
    if mode not in _MODES:
        raise ValueError(f"sequence_attention: mode must be one of {_MODES}, got {mode!r}")
    _state["mode"] = mode


def rotate_method() -> str:
    """``ring_attention``'s method for the current mode (the plain-tensor path reads it too)."""
    return "gather" if _state["mode"] == "gather" else "ring"


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
    """The attention's result, or ``NotImplemented`` where none of the modes applies (no sequence
    shard, a mask, dropout, plain or 3-D tensors): the sharding rule's path runs then."""
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
    if _state["mode"] == "hybrid" and _hybrid_applies(q, k, seq, places):
        return _hybrid(q, k, v, seq, places, a)
    ql, kl, vl = (t.redistribute(mesh, places).to_local() for t in (q, k, v))
    layout = _layout(q.shape[2], [mesh.size(j) for j in seq])
    out = ring_attention(ql, kl, vl, mesh=mesh, mesh_dim=seq[0] if len(seq) == 1 else seq, layout=layout,
                         is_causal=bool(a.get("is_causal")), scale=a.get("scale"),
                         enable_gqa=bool(a.get("enable_gqa")), method=rotate_method())
    return _wrap(out, q, v, places)


def _wrap(out: torch.Tensor, q: DTensor, v: DTensor, places: tuple[Placement, ...]) -> DTensor:
    shape = (*q.shape[:3], v.shape[3])
    return DTensor.from_local(out, q.device_mesh, places, run_check=False, shape=shape,
                              stride=contiguous_stride(shape))


def _hybrid_applies(q: DTensor, k: DTensor, seq: tuple[int, ...], places: tuple[Placement, ...]) -> bool:
    """Two sequence mesh dims, a length they divide, grouped key heads that the outer one and
    any heads shards divide (and no declared order): otherwise the one ring over both runs."""
    if len(seq) != 2 or _state["declared"] or q.ndim != 4:
        return False
    mesh = q.device_mesh
    head_ranks = mesh.size(seq[0]) * math.prod(mesh.size(j) for j, p in enumerate(places) if p.is_shard(1))
    return (q.shape[2] % (mesh.size(seq[0]) * mesh.size(seq[1])) == 0
            and (q.shape[1] == k.shape[1] or k.shape[1] % head_ranks == 0))


def _hybrid(q: DTensor, k: DTensor, v: DTensor, seq: tuple[int, ...], places: tuple[Placement, ...],
            a: dict) -> DTensor:
    """Heads on the outer sequence mesh dim, a ring on the inner one.  Each rank's pieces, seen as
    the shards of the outer dim's group (its sequence: the pieces of every outer rank at this inner
    coordinate, end to end), go to heads by an all-to-all on that dim alone; the ring then runs over
    the inner dim on those strided pieces, and the output goes back the same way."""
    mesh = q.device_mesh
    outer, inner = seq
    pa, pb = mesh.size(outer), mesh.size(inner)
    row = mesh[outer]
    local = [t.redistribute(mesh, places).to_local() for t in (q, k, v)]
    heads = [_move(t, row, Shard(2), Shard(1), (*t.shape[:2], t.shape[2] * pa, t.shape[3])) for t in local]
    pieces = nested(q.shape[2], [pa, pb]).positions
    layout = SeqLayout(tuple(torch.cat([pieces[i * pb + j] for i in range(pa)]) for j in range(pb)), None, "strided")
    out = ring_attention(*heads, mesh=mesh, mesh_dim=inner, layout=layout, is_causal=bool(a.get("is_causal")),
                         scale=a.get("scale"), enable_gqa=bool(a.get("enable_gqa")))
    back = _move(out, row, Shard(1), Shard(2), (out.shape[0], local[0].shape[1], *out.shape[2:]))
    return _wrap(back, q, v, places)


def _move(t: torch.Tensor, row: Any, src: Placement, dst: Placement, shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's piece ``t`` of a ``shape`` tensor sharded ``src`` on the 1-D mesh ``row``,
    redistributed to ``dst`` (an all-to-all there), as a local tensor again (autograd flows)."""
    whole = DTensor.from_local(t, row, [src], run_check=False, shape=shape, stride=contiguous_stride(shape))
    return whole.redistribute(row, [dst]).to_local()


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
