"""Collectives over a mesh dim, through one recording point.

Every collective of the library is one of the functions below.  Each resolves the mesh dim's
group and runs it on the calling rank's transport through ``issue`` (the recording point, which
reports a ``CommEvent`` to every listener), or, while torch.compile traces, records it as an op
of the graph (``traced``) that calls ``issue`` when the graph runs.  Traces, demos and tests
listen here; nothing else talks to a transport.
"""
from __future__ import annotations

from typing import Any

import torch

from .base import DEFAULT_TIMEOUT_S, Completed, GroupSource, MeshDims, Transport, Work, reduce_stack
from .issue import (CommEvent, CommLog, add_listener, current_scope, current_transport, current_world,
                    issue, issue_all_to_all_v, issue_broadcast, issue_send_recv, listening, record, recorded_worlds, recording,
                    remove_listener, scope, selected, tracing)
from .simulated import (CollectiveMismatchError, CollectiveTimeoutError, RankAbortedError, SimTransport, SimWorld,
                        StuckRanksError, current_sim_transport, run_spmd)
from .traced import traced, traced_all_to_all_v

__all__ = [
    "CommEvent", "CommLog", "Transport", "add_listener", "remove_listener", "record", "current_transport",
    "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "all_to_all_v", "broadcast", "barrier", "send_recv",
    "run_spmd",
    "RankAbortedError", "CollectiveTimeoutError", "CollectiveMismatchError", "StuckRanksError", "reduce_stack",
    "DEFAULT_TIMEOUT_S", "scope", "listening",
    "current_scope", "recording", "Work", "Completed", "current_world", "selected", "recorded_worlds",
]

def _collective(kind: str, t: torch.Tensor, mesh: GroupSource, mesh_dim: MeshDims, extra: tuple = (),
                async_op: bool = False) -> Any:
    group = mesh.group_ranks(mesh_dim)
    if tracing(t):  # torch.compile traces: the graph gets an op that runs ``issue``
        out = traced(kind, t, group, mesh_dim, extra)
        return Completed(out) if async_op else out
    return issue(kind, group, mesh_dim, t, extra, async_op)


def all_gather(t: torch.Tensor, mesh: GroupSource, mesh_dim: MeshDims, async_op: bool = False) -> Any:
    """Stack of every group member's ``t``: shape ``(k, *t.shape)``, group-rank order.

    With ``async_op`` every collective here returns a ``Work`` (recorded when waited on).
    """
    return _collective("all_gather", t, mesh, mesh_dim, (), async_op)


def all_reduce(t: torch.Tensor, op: str, mesh: GroupSource, mesh_dim: MeshDims, async_op: bool = False) -> Any:
    """Element-wise ``op`` over the group (a new tensor)."""
    return _collective("all_reduce", t, mesh, mesh_dim, (op,), async_op)


def reduce_scatter(t: torch.Tensor, op: str, mesh: GroupSource, mesh_dim: MeshDims, async_op: bool = False) -> Any:
    """``t`` is ``(k, *s)``; group rank ``i`` gets ``op`` over every member's block ``i``."""
    return _collective("reduce_scatter", t, mesh, mesh_dim, (op,), async_op)


def all_to_all(t: torch.Tensor, mesh: GroupSource, mesh_dim: MeshDims, async_op: bool = False) -> Any:
    """``t`` is ``(k, *s)``; block ``i`` goes to group rank ``i``; result block ``i`` came from it."""
    return _collective("all_to_all", t, mesh, mesh_dim, (), async_op)


def all_to_all_v(sends: list[torch.Tensor], recv_shapes: list[tuple[int, ...]], mesh: GroupSource,
                 mesh_dim: MeshDims, async_op: bool = False) -> Any:
    """Unpadded all-to-all: ``sends[i]`` goes to group rank ``i``; result ``i`` (of shape
    ``recv_shapes[i]``) came from it.  Blocks may differ in shape; empty ones cost nothing."""
    group = mesh.group_ranks(mesh_dim)
    if any(tracing(x) for x in sends[:1]):
        out = traced_all_to_all_v(sends, recv_shapes, group, mesh_dim)
        return Completed(out) if async_op else out
    return issue_all_to_all_v(sends, recv_shapes, group, mesh_dim, async_op)


def broadcast(t: torch.Tensor, src: int, mesh: GroupSource, mesh_dim: MeshDims) -> torch.Tensor:
    """Group rank ``src``'s ``t`` on every member (``t`` elsewhere gives only shape and dtype)."""
    group = mesh.group_ranks(mesh_dim)
    if tracing(t):
        return traced("broadcast", t, group, mesh_dim, (src,))
    return issue_broadcast(t, src, group, mesh_dim)


def send_recv(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
    """Point-to-point by global rank: ``(peer, t)`` of ``sends`` goes to ``peer``; ``(peer, buf)``
    of ``recvs`` is filled from ``peer``.  Every peer makes the matching call (one message per
    peer and direction); waits at most the collective timeout, naming the peers on failure."""
    if any(tracing(t) for _, t in sends + recvs):
        raise NotImplementedError("point-to-point moves (a DTensor moved between meshes) cannot be traced by "
                                  "torch.compile; move it outside the compiled function")
    issue_send_recv(sends, recvs)


def barrier(mesh: GroupSource, mesh_dim: int | None = None) -> None:
    """Wait until every member of the group arrives."""
    group = mesh.group_ranks(mesh_dim)
    mesh.transport.barrier(group)
    record("barrier", mesh_dim, group, mesh.transport.rank, 0, 0, torch.uint8, (), 0.0, mesh.transport.name,
           mesh.transport.world_id, mesh.transport.owner)
