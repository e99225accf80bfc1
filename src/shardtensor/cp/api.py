"""``context_parallel``, ``context_parallel_unshard`` and ``set_rotate_method`` with torch's signatures.

Inside ``with context_parallel(mesh, buffers=[...], buffer_seq_dims=[...]):`` each buffer is this
rank's piece of the sequence (changed in place, restored on exit unless listed in
``no_restore_buffers``), and ``F.scaled_dot_product_attention`` on plain tensors holding those
pieces runs as ring attention over the mesh, returning this rank's piece of the output.

The pieces are torch's: head-tail when the length divides by ``2 x ranks``, ``torch.chunk``'s
otherwise.  Beyond torch: ``load_balance="head_tail"`` balances causal work for any length, and
``document_lengths=[...]`` (a packed sequence) balances each document and keeps attention inside
documents.  It runs on every backend and device (``blocks.py``: torch's fused CPU kernel where it
applies, plain math elsewhere); torch's own needs CUDA and a fused kernel.
``set_rotate_method("alltoall")`` (the ring, default here) or ``"allgather"`` (every block at
once; torch's default) gives the same values, here and for sequence-sharded DTensors.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import comm
from ..tensor import DTensor
from .dtensor import declare_order, rotate_method, sequence_attention, use_declared_orders
from .layout import SeqLayout, contiguous, head_tail, per_document, split_order
from .ring import ring_attention

__all__ = ["context_parallel", "context_parallel_unshard", "set_rotate_method", "default_layout",
           "context_parallel_shard", "enable_dispatcher", "disable_dispatcher"]

_ROTATE = {"alltoall": "ring", "allgather": "gather"}
_local = threading.local()  # the layout of this rank's latest context (simulated ranks are threads)


def set_rotate_method(rotate_method: str) -> None:
    """``"alltoall"``: keys and values travel a ring (at most two blocks held; the default here);
    ``"allgather"``: every rank receives all blocks at once.  Same values, same bytes.  As torch's,
    it applies to sequence-sharded DTensors too (``sequence_attention``)."""
    if rotate_method not in _ROTATE:
        raise NotImplementedError(f"set_rotate_method: rotate_method must be 'alltoall' or 'allgather', "
                                  f"got {rotate_method!r}")
    sequence_attention(_ROTATE[rotate_method])


def default_layout(length: int, ranks: int, load_balance: str | None = None,
                   document_lengths: Sequence[int] | None = None) -> SeqLayout:
    """torch's choice (head-tail when ``length`` divides by ``2 x ranks``, else contiguous), or the
    one asked for: ``load_balance`` in ("head_tail", "contiguous"), or per document."""
    if document_lengths is not None:
        if sum(int(n) for n in document_lengths) != length:
            raise ValueError(f"context_parallel: document_lengths sum to {sum(document_lengths)}, the buffers' "
                             f"sequence has {length} positions")
        return per_document(document_lengths, ranks)
    if load_balance is None:
        return head_tail(length, ranks) if length % (2 * ranks) == 0 else contiguous(length, ranks)
    if load_balance not in ("head_tail", "contiguous"):
        raise ValueError(f"context_parallel: load_balance must be 'head_tail', 'contiguous' or None, "
                         f"got {load_balance!r}")
    return (head_tail if load_balance == "head_tail" else contiguous)(length, ranks)


def _group_dim(mesh: Any) -> Any:
    return 0 if mesh.ndim == 1 else None


def _my_index(mesh: Any) -> int:
    return mesh.group_ranks(_group_dim(mesh)).index(mesh.get_rank())


class _RingSDPA(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` on plain tensors to ring attention."""

    def __init__(self, mesh: Any, layout: SeqLayout) -> None:
        super().__init__()
        self.mesh, self.layout = mesh, layout

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or any(issubclass(t, DTensor) for t in types):
            return func(*args, **kwargs)
        return _local_attention(self.mesh, self.layout, *args, **kwargs)


def _local_attention(mesh: Any, layout: SeqLayout, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                     scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    if attn_mask is not None:
        raise NotImplementedError("scaled_dot_product_attention inside context_parallel: attn_mask is not "
                                  "supported (the ring builds causal and document masks itself); use "
                                  "is_causal=True, or context_parallel(..., document_lengths=[...]) for packed "
                                  "documents")
    if dropout_p:
        raise NotImplementedError(f"scaled_dot_product_attention inside context_parallel: dropout_p={dropout_p} "
                                  "is not supported (random per element); use dropout_p=0.0")
    return ring_attention(query, key, value, mesh=mesh, mesh_dim=_group_dim(mesh), layout=layout,
                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, method=rotate_method())


def _check_buffers(buffers: list[torch.Tensor], dims: list[int], no_restore: set) -> None:
    if len(buffers) != len(dims):
        raise ValueError(f"context_parallel: buffer_seq_dims has {len(dims)} entries for {len(buffers)} buffers")
    for b in no_restore:
        if not any(b is x for x in buffers):
            raise ValueError("context_parallel: no_restore_buffers must be a subset of buffers")
    lengths = {int(b.shape[d]) for b, d in zip(buffers, dims)}
    if len(lengths) > 1:
        raise ValueError(f"context_parallel: the buffers' sequence dims have different lengths {sorted(lengths)}")
    for i, b in enumerate(buffers):
        if isinstance(b, (torch.nn.Parameter, DTensor)):
            raise ValueError(f"context_parallel: buffers[{i}] is a {type(b).__name__}; buffers are plain tensors "
                             "(inputs, labels, position tables), sharded in place")


@contextlib.contextmanager
def context_parallel(mesh: Any, *, buffers: list[torch.Tensor] | None = None,
                     buffer_seq_dims: list[int] | None = None,
                     no_restore_buffers: set[torch.Tensor] | None = None,
                     load_balance: str | None = None,
                     document_lengths: Sequence[int] | None = None) -> Iterator[None]:
    """Shard ``buffers`` on their sequence dims in place, and run attention on those pieces as
    ring attention over ``mesh`` until the block ends (then restore the buffers)."""
    buffers = list(buffers or [])
    dims = list(buffer_seq_dims or [])
    no_restore = no_restore_buffers or set()
    _check_buffers(buffers, dims, no_restore)
    if not buffers:
        raise ValueError("context_parallel: pass the sequence's buffers (inputs, labels, ...) in buffers=[...] "
                         "with their buffer_seq_dims; their length fixes each rank's piece")
    layout = default_layout(int(buffers[0].shape[dims[0]]), mesh.size(), load_balance, document_lengths)
    originals = [None if any(b is x for x in no_restore) else b.clone() for b in buffers]
    with torch.no_grad():
        for b, piece in zip(buffers, _pieces(mesh, layout, buffers, dims)):
            b.resize_(piece.shape)
            b.copy_(piece)
    try:
        with _RingSDPA(mesh, layout):
            yield
    finally:
        with torch.no_grad():
            for b, orig in zip(buffers, originals):
                if orig is not None:
                    b.resize_(orig.shape)
                    b.copy_(orig)


@torch.no_grad()
def context_parallel_unshard(mesh: Any, buffers: list[torch.Tensor], seq_dims: list[int],
                             load_balancer: SeqLayout | None = None) -> list[torch.Tensor]:
    """Each buffer whole, in the sequence's own order, from every rank's piece.  The layout is
    ``load_balancer`` (a ``SeqLayout``), else this rank's latest context's, else torch's rule."""
    if len(buffers) != len(seq_dims):
        raise ValueError(f"context_parallel_unshard: seq_dims has {len(seq_dims)} entries for {len(buffers)} buffers")
    me, ranks = _my_index(mesh), mesh.size()
    layout: SeqLayout | None = load_balancer if load_balancer is not None else getattr(_local, "layout", None)
    n = int(buffers[0].shape[seq_dims[0]]) if buffers else 0
    if layout is None or layout.ranks != ranks or layout.count(me) != n:
        layout = default_layout(n * ranks, ranks)
    out = []
    for b, d in zip(buffers, seq_dims):
        moved = b.movedim(d, 0).contiguous()
        shapes = [(layout.count(j), *moved.shape[1:]) for j in range(ranks)]
        got = comm.all_to_all_v([moved] * ranks, shapes, mesh, _group_dim(mesh))
        whole = torch.cat(list(got)).index_select(0, layout.restore().to(b.device))
        out.append(whole.movedim(0, d))
    return out


# -- the module-wrapper form torchtitan uses (torch's private ``_context_parallel_shard`` and
# ``_enable_context_parallel_dispatcher``): pieces wrapped as sequence-sharded DTensors ----------

def _balanced_layout(load_balancer: Any, length: int, ranks: int) -> SeqLayout:
    """The layout a torch load balancer's index order gives (its ``_generate_indices()``, one row
    for the whole batch), or ``torch.chunk``'s pieces without one."""
    if load_balancer is None:
        return contiguous(length, ranks)
    if isinstance(load_balancer, SeqLayout):
        return load_balancer
    order = load_balancer._generate_indices()
    if order.ndim != 2 or (order.shape[0] > 1 and not bool((order == order[:1]).all())):
        raise NotImplementedError(f"context-parallel sharding: a load balancer's indices of shape {tuple(order.shape)} "
                                  "differ per batch row; one order for the whole batch is supported")
    order = order[0].cpu()
    if order.numel() != length:
        raise ValueError(f"context-parallel sharding: the load balancer orders {order.numel()} positions, the "
                         f"buffers have {length}")
    return split_order(order, ranks, type(load_balancer).__name__)


@torch.no_grad()
def context_parallel_shard(mesh: Any, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                           load_balancer: Any = None) -> list[torch.Tensor]:
    """This rank's piece of each buffer, in the load balancer's order (torch's
    ``_context_parallel_shard``); the order is declared for attention on sequence-sharded DTensors."""
    if len(buffers) != len(seq_dims):
        raise ValueError(f"context-parallel sharding: seq_dims has {len(seq_dims)} entries for {len(buffers)} buffers")
    for i, b in enumerate(buffers):
        if not isinstance(b, torch.Tensor):
            raise NotImplementedError(f"context-parallel sharding: buffers[{i}] is a {type(b).__name__}; "
                                      "shardtensor shards tensors (FlexAttention's BlockMask is not supported)")
    if not buffers:
        return []
    length = int(buffers[0].shape[seq_dims[0]])
    layout = _balanced_layout(load_balancer, length, mesh.size())
    declare_order(layout)
    return _pieces(mesh, layout, buffers, seq_dims)


def _pieces(mesh: Any, layout: SeqLayout, buffers: Sequence[torch.Tensor], dims: Sequence[int]) -> list[torch.Tensor]:
    """This rank's piece of each buffer; ``layout`` becomes this rank's latest (for unsharding)."""
    _local.layout = layout
    mine = layout.positions[_my_index(mesh)]
    return [b.index_select(d, mine.to(b.device)) for b, d in zip(buffers, dims)]


def enable_dispatcher() -> None:
    """Attention on sequence-sharded DTensors reads the order ``context_parallel_shard`` declared
    (torch's ``_enable_context_parallel_dispatcher``)."""
    use_declared_orders(True)


def disable_dispatcher() -> None:
    use_declared_orders(False)
