"""``RaggedShard(dim, local_units)``: a dim split into per-rank pieces of chosen sizes.

Rank ``r`` of the mesh dim holds a piece proportional to ``local_units[r]``: on 20 rows,
``local_units=(1, 2, 1, 1)`` gives rows 0-3, 4-11, 12-15 and 16-19.  The boundary after rank
``r`` is ``length * (units[0] + ... + units[r]) // sum(units)``: the pieces in rank order make
the tensor, each boundary within one element of its proportional place, exact where the length
divides by ``sum(units)``.  A unit of zero is an empty piece.  Whole matrices per rank (an
optimizer step that needs them), block-aligned pieces (quantized weights), uneven activations.

It nests like ``Shard`` (mesh dims split a tensor dim left to right, or in a given shard order).
No sharding rule reads it: elementwise ops on matching layouts keep it with no communication,
other ops see its mesh dim gathered.  A redistribution to or from it is one exchange of blocks
in which every rank receives exactly what it lacks.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Sequence

from .base import ORDERED, Placement, check_int, wrap_dim


@dataclass(frozen=True, slots=True, init=False)
class RaggedShard(Placement):
    """Tensor dim ``dim`` split into one piece per rank of the mesh dim, proportional to
    ``local_units`` (one non-negative int per rank, not all zero)."""

    __module__ = "shardtensor.placement"
    nests = ORDERED
    rules_read = False
    planned = False

    dim: int
    local_units: tuple[int, ...]

    def __init__(self, dim: int, local_units: Sequence[int]) -> None:
        check_int("RaggedShard", "dim", dim)
        if isinstance(local_units, (str, bytes)) or not isinstance(local_units, Sequence):
            raise TypeError(f"RaggedShard local_units must be a sequence of ints, got {local_units!r}")
        for u in local_units:
            check_int("RaggedShard", "local_units entry", u)
        units = tuple(int(u) for u in local_units)
        if not units or min(units) < 0 or sum(units) == 0:
            raise ValueError(f"RaggedShard local_units must be non-negative with a positive sum, got {local_units!r}")
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "local_units", units)

    def tensor_dim(self) -> int:
        return self.dim

    def pieces(self, length: int, k: int, r: int) -> list[tuple[int, int]]:
        self._check_ranks(k)
        lo, hi = self.bounds(length)[r:r + 2]
        return [(hi - lo, lo)]

    def _check_ranks(self, k: int) -> None:
        if k != len(self.local_units):
            raise ValueError(f"{self!r} gives {len(self.local_units)} pieces for a mesh dim of {k} ranks; "
                             "give one local unit per rank")

    def bounds(self, length: int) -> list[int]:
        """The ``k + 1`` boundaries of the pieces of a dim of ``length``."""
        total = sum(self.local_units)
        return [length * c // total for c in itertools.accumulate(self.local_units, initial=0)]

    def normalized(self, ndim: int, mesh_size: int | None = None) -> Placement:
        if mesh_size is not None:
            self._check_ranks(mesh_size)
        d = wrap_dim(self, self.dim, ndim)
        return self if d == self.dim else RaggedShard(d, self.local_units)

    def global_length(self, local_length: int, k: int) -> int | None:
        return None  # one piece does not give the others: from_local gathers the sizes or takes shape=

    @classmethod
    def from_text(cls, text: str) -> Placement | None:
        m = re.fullmatch(r"(?:rs|raggedshard|ragged)\((?:dim=)?(-?\d+),(?:local_units=)?[\[(]?([\d:,]+?)[\])]?\)",
                         text)
        return None if m is None else cls(int(m.group(1)), [int(u) for u in re.split(r"[:,]", m.group(2))])

    def __repr__(self) -> str:
        return f"RaggedShard(dim={self.dim}, local_units={self.local_units})"

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        return repr(self), {"RaggedShard": RaggedShard}

    def __str__(self) -> str:
        return f"RS({self.dim},{':'.join(map(str, self.local_units))})"
