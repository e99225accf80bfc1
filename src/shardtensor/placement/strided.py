"""``StridedShard(dim, split_factor)``: a packed layout (each rank holds its piece of every group).

The layout of a fused weight (a packed gate/up projection: each rank holds its slice of both
halves) and torch's ``_StridedShard`` (also spelled with ``sf=``).  No sharding rule reads it
(dispatch gathers it first, except for elementwise ops on matching layouts) and the collective
planner does not move it (a redistribution exchanges blocks: each rank receives what it lacks).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .base import LAST, Placement, check_int, chunk, wrap_dim
from .shard import Shard


@dataclass(frozen=True, slots=True, init=False)
class StridedShard(Placement):
    """Tensor dim ``dim`` is cut into ``split_factor`` groups and each group is split across the
    mesh dim (both by the torch.chunk rule); a rank holds its piece of every group, in group order.

    It applies after every ``Shard`` of the same tensor dim, so it comes after them in the
    placements.  Not a ``Shard``: ``is_shard()`` is False, as for torch's.
    """

    __module__ = "shardtensor.placement"
    nests = LAST
    rules_read = False
    planned = False

    dim: int
    split_factor: int

    def __init__(self, dim: int, split_factor: int = 1, *, sf: int | None = None) -> None:
        if sf is not None:
            if split_factor != 1:
                raise TypeError("StridedShard: give split_factor or sf, not both")
            split_factor = sf
        check_int("StridedShard", "dim", dim)
        check_int("StridedShard", "split_factor", split_factor)
        if split_factor < 1:
            raise ValueError(f"StridedShard split_factor must be at least 1, got {split_factor}")
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "split_factor", split_factor)

    @property
    def sf(self) -> int:
        return self.split_factor

    def tensor_dim(self) -> int:
        return self.dim

    def pieces(self, length: int, k: int, r: int) -> list[tuple[int, int]]:
        return strided_runs(length, self.split_factor, k, r)

    def normalized(self, ndim: int, mesh_size: int | None = None) -> Placement:
        d = wrap_dim(self, self.dim, ndim)
        if self.split_factor == 1:
            return Shard(d)
        return self if d == self.dim else StridedShard(d, self.split_factor)

    @classmethod
    def from_text(cls, text: str) -> Placement | None:
        m = re.fullmatch(r"(?:ss|stridedshard)\((?:dim=)?(-?\d+),(?:split_factor=|sf=)?(\d+)\)", text)
        return None if m is None else cls(int(m.group(1)), int(m.group(2)))

    def __repr__(self) -> str:
        return f"StridedShard(dim={self.dim}, split_factor={self.split_factor})"

    def __fx_repr__(self) -> tuple[str, dict]:
        return repr(self), {"StridedShard": StridedShard}

    def __str__(self) -> str:
        return f"SS({self.dim},{self.split_factor})"


def strided_runs(length: int, split_factor: int, k: int, r: int) -> list[tuple[int, int]]:
    """``(size, offset)`` of each group's piece that rank ``r`` of ``k`` holds under a
    ``StridedShard`` of ``split_factor`` groups of a dim of ``length`` (offsets within it)."""
    runs = []
    for g in range(split_factor):
        g_size, g_off = chunk(length, split_factor, g)
        size, off = chunk(g_size, k, r)
        runs.append((size, g_off + off))
    return runs
