"""Checkpoints: DTensors save and load through ``torch.distributed.checkpoint`` (DCP).

DCP asks each tensor-like value of a state dict three questions, through its public protocol
for tensor subclasses; :class:`~shardtensor.DTensor` answers them here:

* ``__create_write_items__``: one write item per rank, the block this rank holds (its offset and
  size in the global tensor, the global size, the dtype).  Replicas write the same block and DCP
  keeps one copy.
* ``__create_chunk_list__``: the block this rank wants when loading.
* ``__get_tensor_shard__``: the local tensor itself, which DCP reads from when saving and copies
  into when loading.

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


def _block(t: "DTensor") -> tuple[torch.Size, torch.Size] | None:
    """This rank's block (sizes, offsets) in the global tensor; None when it is empty."""
    _values_only(t)
    spec = t._spec
    sizes, offsets = spec.local_shape_and_offset()
    if math.prod(sizes) == 0 and math.prod(spec.shape) > 0:
        return None
    return torch.Size(sizes), torch.Size(offsets)


def chunk_list(t: "DTensor") -> list:
    """DCP's ``__create_chunk_list__``: the block this rank holds, as DCP chunk metadata."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    block = _block(t)
    return [] if block is None else [ChunkStorageMetadata(offsets=block[1], sizes=block[0])]


def write_items(fqn: str, t: "DTensor") -> list:
    """DCP's ``__create_write_items__``: one shard write item for this rank's block."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties.create_from_tensor(t._local_tensor)
    return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk, properties=props, size=t.size()))
            for chunk in chunk_list(t)]


def local_block(t: "DTensor", index: Any = None) -> torch.Tensor:
    """DCP's ``__get_tensor_shard__``: the local tensor (saved from, loaded into in place)."""
    _values_only(t)
    return t._local_tensor


from .saving import load, save  # noqa: E402  (DCP's save and load, the simulated world included)
