"""``Shard(dim)``: tensor dim ``dim`` split across the mesh dim by the torch.chunk rule."""
from __future__ import annotations

from dataclasses import dataclass

from .base import ORDERED, Placement, check_int, chunk, wrap_dim


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Tensor dim ``dim`` is split across the mesh dim by the torch.chunk rule."""

    __module__ = "shardtensor.placement"  # the name pickles and torch's safe globals know it by
    nests = ORDERED

    dim: int

    def __post_init__(self) -> None:
        check_int("Shard", "dim", self.dim)

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def tensor_dim(self) -> int:
        return self.dim

    def pieces(self, length: int, k: int, r: int) -> list[tuple[int, int]]:
        return [chunk(length, k, r)]

    def normalized(self, ndim: int, mesh_size: int | None = None) -> Placement:
        d = wrap_dim(self, self.dim, ndim)
        return self if d == self.dim else Shard(d)

    @staticmethod
    def local_shard_size_and_offset(curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """Size and offset of piece ``rank`` of ``num_chunks`` torch.chunk pieces of a length
        (torch's public static method; the offset is relative to that length)."""
        return chunk(curr_local_size, num_chunks, rank)

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __fx_repr__(self) -> tuple[str, dict]:  # torch.compile writes the placement into graph code
        return f"Shard({self.dim})", {"Shard": Shard}

    def __str__(self) -> str:
        return f"S({self.dim})"
