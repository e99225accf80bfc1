"""Checkpoints: DTensors save and load through ``torch.distributed.checkpoint`` (DCP).

DCP asks each tensor-like value of a state dict three questions, through its public protocol
for tensor subclasses; :class:`~shardtensor.DTensor` answers them (``shardtensor/blocks.py``):

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

from .saving import load, save

__all__ = ["load", "save"]
