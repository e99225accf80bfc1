"""``Replicate()``: every rank of the mesh dim holds the whole value."""
from __future__ import annotations

from dataclasses import dataclass

from .base import Placement


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank of the mesh dim holds the whole value."""

    __module__ = "shardtensor.placement"

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"

    def __fx_repr__(self) -> tuple[str, dict]:
        return "Replicate()", {"Replicate": Replicate}

    def __str__(self) -> str:
        return "R"
