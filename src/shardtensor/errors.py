"""The errors shardtensor raises on purpose: one base, ``ShardingError``, and one class per kind.

Each kind also derives from the standard exception type that torch's DTensor raises in the same
situation, so code written for DTensor (``except RuntimeError``, ``except NotImplementedError``)
keeps working, while code that wants to tell them apart catches the class.
"""
from __future__ import annotations

__all__ = ["ShardingError", "UnsupportedOpError", "PropagationError", "MeshMismatchError", "MixedTensorError",
           "CommError", "RankAbortedError", "CollectiveMismatchError", "CollectiveTimeoutError", "StuckRanksError",
           "ReplicateFallbackWarning"]


class ShardingError(Exception):
    """Base of every error shardtensor raises on purpose."""


class UnsupportedOpError(ShardingError, NotImplementedError):
    """An op has no sharding rule (and no decomposition) for these input placements; the message
    names the op and the placements, and ``op`` is the op."""

    def __init__(self, message: str, op: object = None) -> None:
        super().__init__(message)
        self.op = op


class PropagationError(ShardingError, RuntimeError):
    """A sharding rule refused its inputs: an in-place op whose result needs other placements, a
    write through a view that is a copy, a Partial input an op cannot take, inconsistent list
    arguments.  The message names the op, the placements and what to do."""


class MeshMismatchError(ShardingError, RuntimeError, ValueError):
    """Tensor arguments of one op live on different meshes."""


class MixedTensorError(ShardingError, RuntimeError):
    """A plain tensor met DTensors where it cannot be taken as a replicated value.

    A RuntimeError, as torch's DTensor raises: a TypeError raised under ``Tensor.__add__`` would
    be turned by torch into ``NotImplemented`` and end as Python's bare "unsupported operand".
    """


class CommError(ShardingError, RuntimeError):
    """A collective could not complete."""


class RankAbortedError(CommError):
    """Raised in a rank whose collective cannot finish because another rank failed."""


class CollectiveMismatchError(CommError):
    """Ranks of one group issued different collectives at the same place in the group's order."""


class CollectiveTimeoutError(ShardingError, TimeoutError):
    """A collective did not complete within the timeout; the message names the ranks that never arrived."""


class StuckRanksError(ShardingError, TimeoutError):
    """Ranks still ran after the world failed or its other ranks finished, past the timeout."""


class ReplicateFallbackWarning(UserWarning):
    """An op without a sharding rule ran on replicated inputs (exact, but every rank gathered its
    inputs whole); issued once per op.  ``shardtensor.strict_sharding()`` makes it an error."""
