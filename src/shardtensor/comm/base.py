"""The transport interface: the six collectives every backend provides over a group of ranks.

A group is a tuple of global ranks in group-rank order (the order of a mesh dim's
coordinates).  Stacked layouts keep the interface small: gathers return ``(k, *shape)``,
reduce-scatter and all-to-all take ``(k, *shape)``; block ``i`` belongs to group rank ``i``.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch

Group = tuple[int, ...]

DEFAULT_TIMEOUT_S = float(os.environ.get("SHARDTENSOR_COMM_TIMEOUT", "120"))


def reduce_stack(stacked: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce a ``(k, ...)`` stack over dim 0 with one of the Partial reduce ops."""
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.sum(0) / stacked.shape[0] if stacked.is_floating_point() else stacked.sum(0) // stacked.shape[0]
    if op == "max":
        return stacked.amax(0)
    if op == "min":
        return stacked.amin(0)
    if op == "product":
        return stacked.prod(0)
    raise ValueError(f"unknown reduce op {op!r}")


class Transport(ABC):
    """One rank's view of a world of ranks; the only thing that moves data."""

    name: str = "transport"
    rank: int
    world_size: int

    def prepare_groups(self, groups: list[Group]) -> None:
        """Called by every rank with the same list when a mesh is built (collective)."""

    @abstractmethod
    def all_gather(self, t: torch.Tensor, group: Group) -> torch.Tensor: ...

    @abstractmethod
    def all_reduce(self, t: torch.Tensor, op: str, group: Group) -> torch.Tensor: ...

    @abstractmethod
    def reduce_scatter(self, t: torch.Tensor, op: str, group: Group) -> torch.Tensor: ...

    @abstractmethod
    def all_to_all(self, t: torch.Tensor, group: Group) -> torch.Tensor: ...

    @abstractmethod
    def broadcast(self, t: torch.Tensor, src: int, group: Group) -> torch.Tensor: ...

    @abstractmethod
    def barrier(self, group: Group) -> None: ...
