"""A DTensor's blocks as ``torch.distributed.checkpoint`` (DCP) asks for them.

DCP asks each tensor-like value of a state dict three questions, through its public protocol for
tensor subclasses; ``DTensor``'s protocol methods answer from its spec and local tensor here:

* ``__create_write_items__``: one write item per block this rank holds (its offset and size in
  the global tensor, the global size, the dtype).  Replicas write the same block and DCP keeps
  one copy.
* ``__create_chunk_list__``: the blocks this rank wants when loading.
* ``__get_tensor_shard__``: the local tensor itself (or, for a packed layout, the view of it that
  holds the block asked for), which DCP reads from when saving and copies into when loading.

A ``StridedShard`` rank holds one block per group; a ``Partial`` one holds unsummed terms and is
refused; a rank whose block is empty writes and reads nothing.  See ``shardtensor.checkpoint``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .placement import local_blocks
from .spec import DTensorSpec

__all__ = ["chunk_list", "local_block", "write_items"]


def _values_only(spec: DTensorSpec) -> None:
    """Refuse a Partial DTensor: its local tensors are unsummed terms, not values."""
    partial = [i for i, p in enumerate(spec.placements) if p.is_partial()]
    if partial:
        raise ValueError(f"cannot checkpoint a DTensor with placements {tuple(spec.placements)}: a Partial holds "
                         f"unsummed terms on mesh dims {partial}; redistribute it to Replicate (or Shard) first, "
                         "e.g. t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)")


def _blocks(spec: DTensorSpec) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """This rank's blocks ``(sizes, global offsets, offsets in the local tensor)``, none empty:
    one block, or one per group piece of each StridedShard dim (a packed layout holds several)."""
    _values_only(spec)
    if math.prod(spec.shape) == 0:  # an empty tensor: one (empty) block names it
        sizes, offsets = spec.local_shape_and_offset()
        return [(tuple(sizes), tuple(offsets), (0,) * len(sizes))]
    coord = spec.mesh.get_coordinate()
    if coord is None:  # a rank off the mesh holds nothing
        return []
    return local_blocks(spec.shape, spec.mesh.shape, coord, spec.placements, spec.shard_order)


def chunk_list(spec: DTensorSpec) -> list:
    """DCP's ``__create_chunk_list__``: the blocks this rank holds, as DCP chunk metadata."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for n, o, _ in _blocks(spec)]


def write_items(fqn: str, spec: DTensorSpec, local: torch.Tensor) -> list:
    """DCP's ``__create_write_items__``: one shard write item per block of this rank."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties.create_from_tensor(local)
    return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size(spec.shape)))
            for chunk in chunk_list(spec)]


def local_block(spec: DTensorSpec, local: torch.Tensor, index: Any = None) -> torch.Tensor:
    """DCP's ``__get_tensor_shard__``: the local tensor, or (for a packed layout) the view of it
    that holds the block at ``index.offset`` (saved from, loaded into in place)."""
    _values_only(spec)
    if len(_blocks(spec)) <= 1:
        return local
    want = tuple(getattr(index, "offset", None) or ())
    for sizes, offsets, starts in _blocks(spec):
        if offsets == want:
            view = local
            for d, (n, s) in enumerate(zip(sizes, starts)):
                view = view.narrow(d, s, n)
            return view
    raise ValueError(f"checkpoint: this rank holds no block of {tuple(spec.shape)} at offset {want}")
