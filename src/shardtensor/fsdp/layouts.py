"""Ready-made ``shard_placement_fn``s for ``fully_shard``: ragged data-parallel layouts.

``fully_shard(m, mesh=mesh, shard_placement_fn=fn)`` asks ``fn(param)`` for each parameter's
placement on the dp mesh dim (``None``: ``Shard(0)``).  Besides ``Shard(0)`` FSDP packs any
``RaggedShard(0, local_units)``; the two layouts users ask for most are built here:

* ``whole_parameters(module, world)``: every parameter whole on one rank, dealt largest first to
  the rank holding the fewest elements so far: an optimizer step that needs whole matrices
  (Muon, Shampoo) runs on each rank's own parameters with no communication;
* ``block_aligned(world, block=128)``: each rank's piece starts on a multiple of ``block``
  elements of the flattened parameter, the blocks dealt out as ``torch.chunk`` deals rows: every
  quantization block (fp8 / int4 with 128-element scales) lies whole on one rank.

The all-gather packs every rank's pieces end to end and pads each rank's block to the longest,
so the bytes it moves are ``world x`` the largest rank's share: balance is what keeps them low.
"""
from __future__ import annotations

import math
from typing import Callable

import torch.nn as nn

from ..placement import Placement, RaggedShard, chunk_sizes
from ..tensor import DTensor
from .api import managed_params

__all__ = ["block_aligned", "deal_largest_first", "whole_parameters"]


def deal_largest_first(sizes: list[int], k: int) -> list[int]:
    """A rank of ``k`` for each size: largest first, each to the rank with the least so far
    (ties: the lower rank).  The greedy rule for balancing whole items across ranks."""
    load = [0] * k
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(k), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += sizes[i]
    return out


def _check_world(world: int) -> None:
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be the dp mesh dim's size (a positive int), got {world!r}")


def whole_parameters(module: nn.Module, world: int) -> Callable[[nn.Parameter], Placement]:
    """A ``shard_placement_fn`` giving each parameter ``fully_shard(module)`` will manage whole to
    one of ``world`` dp ranks (``RaggedShard(0, one-hot units)``), balanced by element count.
    Build it after the children's ``fully_shard`` (bottom-up, as FSDP is applied): their
    parameters are theirs, and are not dealt here."""
    _check_world(world)
    params = [p for p, _ in managed_params([module])]
    ranks = deal_largest_first([p.numel() for p in params], world)
    owner = {id(p): r for p, r in zip(params, ranks)}

    def fn(p: nn.Parameter) -> Placement:
        if id(p) not in owner:
            raise ValueError(f"whole_parameters: a parameter of shape {tuple(p.shape)} is not one of the module's "
                             "it was built from; build it from the module passed to fully_shard")
        return RaggedShard(0, [int(r == owner[id(p)]) for r in range(world)])
    return fn


def block_aligned(world: int, block: int = 128) -> Callable[[nn.Parameter], Placement]:
    """A ``shard_placement_fn`` cutting dim 0 of each parameter where the flattened parameter's
    ``block``-element blocks meet: the blocks (the last may be short) dealt out in order by the
    ``torch.chunk`` rule, so no block is split across ranks."""
    _check_world(world)
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block_aligned: block must be a positive int (elements), got {block!r}")

    def fn(p: nn.Parameter) -> Placement:
        if isinstance(p, DTensor):
            raise NotImplementedError(f"block_aligned: the parameter of shape {tuple(p.shape)} is a DTensor (TP); "
                                      "its blocks would be cut per tp rank. Use it on plain parameters")
        if p.ndim == 0:
            raise ValueError("block_aligned: a 0-d parameter has no dim 0 to cut; make it 1-d")
        rows = p.shape[0]
        row = math.prod(p.shape[1:])
        per = math.lcm(row, block) // row if row else 1  # rows per block: its boundaries fall on row boundaries
        nblocks = -(-rows // per)
        units, at = [], 0
        for n in chunk_sizes(nblocks, world):  # each rank's rows: its blocks, the last block cut at the end of the dim
            units.append(min(rows, (at + n) * per) - min(rows, at * per))
            at += n
        return RaggedShard(0, units if rows else [1] * world)
    return fn
