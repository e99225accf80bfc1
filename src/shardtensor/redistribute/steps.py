"""The plan types: a plan is a tuple of steps, each one collective (or a local op) that changes
the placement of one mesh dim, or of several at once (``FlatStep``, ``ExchangeStep``).

A step records the state before it (placements and shard order), so the executor derives the
logical shape it works on, and so every rank runs the same collectives in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..placement import Placement, ShardOrder
from .moves import move

__all__ = ["Step", "FlatStep", "ExchangeStep", "transition_kind"]


@dataclass(frozen=True)
class Step:
    """Change mesh dim ``mesh_dim`` from ``src`` to ``dst`` in state ``(placements, order)``."""

    mesh_dim: int
    src: Placement
    dst: Placement
    placements: tuple[Placement, ...]
    order: ShardOrder

    @property
    def collective(self) -> str:
        return transition_kind(self.src, self.dst)

    @property
    def mesh_dims(self) -> tuple[int, ...]:
        """The mesh dims the step's collective spans (one for a plain step)."""
        return (self.mesh_dim,)


@dataclass(frozen=True)
class FlatStep(Step):
    """One collective over the flattened group of several mesh dims, all going ``src -> dst``.

    ``dims`` lists the mesh dims major first: the group rank is the row-major index of the
    coordinates on ``dims``.  For ``S(d) -> R`` they are the last entries of ``d``'s list in
    list order; for ``P -> S(d)`` they are appended to ``d``'s list in that order; for
    ``P -> R`` any order.  ``mesh_dim`` is ``dims[0]``.
    """

    dims: tuple[int, ...] = ()

    @property
    def mesh_dims(self) -> tuple[int, ...]:
        return self.dims


@dataclass(frozen=True)
class ExchangeStep(Step):
    """The whole change of ``dims`` (ascending) as one all-to-all over their flattened group:
    every rank sends each peer the part of its block that the peer's target block needs
    (``exchange.py``).  The state after it is ``(target, target_order)``."""

    dims: tuple[int, ...] = ()
    target: tuple[Placement, ...] = ()
    target_order: ShardOrder = ()

    @property
    def mesh_dims(self) -> tuple[int, ...]:
        return self.dims

    @property
    def collective(self) -> str:
        return "all_to_all"


def transition_kind(src: Placement, dst: Placement) -> str:
    """Name of the collective (or local op) a single-mesh-dim transition uses (``moves.py``)."""
    return move(src, dst).collective
