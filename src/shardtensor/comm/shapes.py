"""A world of shapes: one rank of a large world runs alone, and collectives give only shapes.

``run_one_rank(fn, world_size)`` runs ``fn`` on the calling thread as rank 0 of a world of
``world_size`` ranks, with no peers at all: every collective returns a tensor of the shape the
real one would return (``torch.empty`` on the input's device, no data moved) and is recorded
through ``issue`` like any other, with the same bytes.  On the ``meta`` device nothing is
allocated, so a step of a model far larger than this machine runs in a fraction of a second and
its comm trace is the trace rank 0 would record in a world of that size.  This is how
``shardtensor.autoshard`` prices a plan.

SPMD code takes the same path on every rank, and rank 0 holds the largest piece of every uneven
split (the ``torch.chunk`` rule), so its trace is the one to budget for.  Values are not
computed: code that reads a value (``.item()``, a data-dependent shape) cannot run here, which
on ``meta`` it could not anyway.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from .base import Completed, Group, Transport, Work
from .simulated import _ctx

__all__ = ["ShapeTransport", "run_one_rank", "one_rank"]


class ShapeTransport(Transport):
    """Rank ``rank`` of a world of ``world_size`` whose collectives only shape their results."""

    name = "shapes"

    def __init__(self, world_size: int, rank: int = 0) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.world_size, self.rank = world_size, rank

    @staticmethod
    def _done(out: Any, async_op: bool) -> Any:
        return Completed(out) if async_op else out

    def all_gather(self, t: torch.Tensor, group: Group, *, async_op: bool = False) -> torch.Tensor | Work:
        return self._done(t.new_empty((len(group), *t.shape)), async_op)

    def all_reduce(self, t: torch.Tensor, op: str, group: Group, *, async_op: bool = False) -> torch.Tensor | Work:
        return self._done(torch.empty_like(t, memory_format=torch.contiguous_format), async_op)

    def reduce_scatter(self, t: torch.Tensor, op: str, group: Group, *,
                       async_op: bool = False) -> torch.Tensor | Work:
        return self._done(t.new_empty(t.shape[1:]), async_op)

    def all_to_all(self, t: torch.Tensor, group: Group, *, async_op: bool = False) -> torch.Tensor | Work:
        return self._done(torch.empty_like(t, memory_format=torch.contiguous_format), async_op)

    def all_to_all_v(self, sends: list[torch.Tensor], recv_shapes: list[tuple[int, ...]], group: Group, *,
                     async_op: bool = False) -> "list[torch.Tensor] | Work":
        ref = sends[group.index(self.rank)]
        return self._done([ref.new_empty(s) for s in recv_shapes], async_op)

    def broadcast(self, t: torch.Tensor, src: int, group: Group) -> torch.Tensor:
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    def send_recv(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        return None  # the buffers keep their (absent) values

    def barrier(self, group: Group) -> None:
        return None

    def gather_objects(self, payload: Any) -> list[Any]:
        """Every rank's payload: here, this rank's for all (SPMD ranks hand in alike)."""
        return [payload] * self.world_size


@contextmanager
def one_rank(world_size: int, rank: int = 0) -> Iterator[ShapeTransport]:
    """Inside: the calling thread is ``rank`` of a world of shapes of ``world_size`` ranks."""
    if _ctx.transport is not None:
        raise RuntimeError("a world of shapes cannot be opened inside a simulated rank")
    tr = ShapeTransport(world_size, rank)
    _ctx.transport = tr
    try:
        yield tr
    finally:
        _ctx.transport = None


def run_one_rank(fn: Callable[..., Any], world_size: int, *args: Any, rank: int = 0, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` as ``rank`` of a world of shapes of ``world_size`` ranks."""
    with one_rank(world_size, rank):
        return fn(*args, **kwargs)
