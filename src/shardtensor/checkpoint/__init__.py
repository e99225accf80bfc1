"""Checkpoints: DTensors save and load through ``torch.distributed.checkpoint`` (DCP).

DCP asks each tensor-like value of a state dict three questions, through its public protocol
for tensor subclasses; :class:`~shardtensor.DTensor` answers them here:

* ``__create_write_items__``: one write item per rank, the block this rank holds (its offset and
  size in the global tensor, the global size, the dtype).  Replicas write the same block and DCP
  keeps one copy.
* ``__create_chunk_list__``: the block this rank wants when loading.
* ``__get_tensor_shard__``: the local tensor itself, which DCP reads from when saving and copies
  into when loading.

A ``StridedShard`` rank holds one block per group (its piece of each packed half, say): it
answers with each block, and with the view of its local tensor that holds the block asked for.

So the files are DCP's own format: each saved block is a chunk of a global tensor, and a load
reads whatever chunks overlap the blocks of the target layout.  A checkpoint saved on one mesh,
placement or nesting order loads into any other, or into plain tensors with DCP's tools.

``save`` and ``load`` (in ``saving.py``) are DCP's, and also work in the simulated world.

A ``Partial`` DTensor holds unsummed terms, not values, and is refused with an error that
says to redistribute it first.  A rank whose block is empty (7 rows over 8 ranks, say) writes
and reads nothing.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ..placement import local_blocks

if TYPE_CHECKING:
    from ..tensor import DTensor

__all__ = ["chunk_list", "load", "local_block", "save", "write_items"]


def _values_only(t: "DTensor") -> None:
    """Refuse a Partial DTensor: its local tensors are unsummed terms, not values."""
    partial = [i for i, p in enumerate(t._spec.placements) if p.is_partial()]
    if partial:
        raise ValueError(f"cannot checkpoint a DTensor with placements {tuple(t._spec.placements)}: a Partial holds "
                         f"unsummed terms on mesh dims {partial}; redistribute it to Replicate (or Shard) first, "
                         "e.g. t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)")


def _blocks(t: "DTensor") -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """This rank's blocks ``(sizes, global offsets, offsets in the local tensor)``, none empty:
    one block, or one per group piece of each StridedShard dim (a packed layout holds several)."""
    _values_only(t)
    spec = t._spec
    if math.prod(spec.shape) == 0:  # an empty tensor: one (empty) block names it
        sizes, offsets = spec.local_shape_and_offset()
        return [(tuple(sizes), tuple(offsets), (0,) * len(sizes))]
    coord = spec.mesh.get_coordinate()
    if coord is None:  # a rank off the mesh holds nothing
        return []
    return local_blocks(spec.shape, spec.mesh.shape, coord, spec.placements, spec.shard_order)


def chunk_list(t: "DTensor") -> list:
    """DCP's ``__create_chunk_list__``: the blocks this rank holds, as DCP chunk metadata."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for n, o, _ in _blocks(t)]


def write_items(fqn: str, t: "DTensor") -> list:
    """DCP's ``__create_write_items__``: one shard write item per block of this rank."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties.create_from_tensor(t._local_tensor)
    return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk, properties=props, size=t.size()))
            for chunk in chunk_list(t)]


def local_block(t: "DTensor", index: Any = None) -> torch.Tensor:
    """DCP's ``__get_tensor_shard__``: the local tensor, or (for a packed layout) the view of it
    that holds the block at ``index.offset`` (saved from, loaded into in place)."""
    _values_only(t)
    if not t._spec.strided or math.prod(t._spec.shape) == 0:
        return t._local_tensor
    want = tuple(getattr(index, "offset", None) or ())
    for sizes, offsets, starts in _blocks(t):
        if offsets == want:
            view = t._local_tensor
            for d, (n, s) in enumerate(zip(sizes, starts)):
                view = view.narrow(d, s, n)
            return view
    raise ValueError(f"checkpoint: this rank holds no block of {tuple(t.shape)} at offset {want}")


from .saving import load, save  # noqa: E402  (DCP's save and load, the simulated world included)
