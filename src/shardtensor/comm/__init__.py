"""Collectives over a mesh dim, through one recording point.

Every collective of the library is one of the functions below.  Each resolves the mesh
dim's group, runs the transport of the mesh, and reports a ``CommEvent`` (kind, mesh dim,
group, bytes sent and received by this rank under the ring model, dtype, time) to every
listener.  Traces, demos and tests listen here; nothing else talks to a transport.
"""
from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from .base import DEFAULT_TIMEOUT_S, Completed, Group, Transport, Work, reduce_stack
from .simulated import (CollectiveMismatchError, CollectiveTimeoutError, RankAbortedError, SimTransport, SimWorld,
                        StuckRanksError, current_sim_transport, run_spmd)

if TYPE_CHECKING:
    from ..mesh import DeviceMesh

__all__ = [
    "CommEvent", "CommLog", "Transport", "add_listener", "remove_listener", "record", "current_transport",
    "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "all_to_all_v", "broadcast", "barrier", "run_spmd",
    "RankAbortedError", "CollectiveTimeoutError", "CollectiveMismatchError", "StuckRanksError", "reduce_stack",
    "DEFAULT_TIMEOUT_S", "scope", "listening",
    "current_scope", "recording", "Work", "Completed", "current_world", "selected", "recorded_worlds",
]


@dataclass(frozen=True)
class CommEvent:
    """One collective as seen by one rank."""

    kind: str
    rank: int
    mesh_dim: int | tuple[int, ...] | None
    group: Group
    bytes_sent: int
    bytes_received: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    seconds: float
    backend: str
    scope: tuple[str, ...] = ()
    start: float = 0.0
    world: int = 0
    """The world the collective ran in: a simulated world's id (``run_spmd`` call), 0 for torch.distributed."""
    owner: int = 0
    """The thread that started the simulated world (``threading.get_ident()``), 0 for torch.distributed."""

    @property
    def group_size(self) -> int:
        return len(self.group)


MeshDims = int | tuple[int, ...] | None
"""A mesh dim, a tuple of mesh dims (their flattened group, first dim most significant), or None (the mesh)."""

_listeners: list[Callable[[CommEvent], None]] = []
_lock = threading.Lock()
_scopes = threading.local()


def listening() -> bool:
    """True while someone records collectives (callers skip scope bookkeeping otherwise)."""
    return bool(_listeners)


@contextmanager
def scope(label: str) -> Iterator[None]:
    """Attribute the collectives inside to ``label`` (a module name, an op, ``redistribute``)."""
    stack = getattr(_scopes, "stack", None)
    if stack is None:
        stack = _scopes.stack = []
    stack.append(label)
    try:
        yield
    finally:
        stack.pop()


def current_scope() -> tuple[str, ...]:
    return tuple(getattr(_scopes, "stack", ()))


def add_listener(fn: Callable[[CommEvent], None]) -> None:
    with _lock:
        _listeners.append(fn)


def remove_listener(fn: Callable[[CommEvent], None]) -> None:
    with _lock:
        _listeners.remove(fn)


def selected(ev: CommEvent, rank: int | None, world: int | None, owner: int | None = None) -> bool:
    """Whether a recorder filtering on ``rank``, ``world`` and the thread that started the world
    (``owner``; None: any) keeps ``ev``.  torch.distributed's events (world 0) belong to every thread."""
    return ((rank is None or ev.rank == rank) and (world is None or ev.world == world)
            and (owner is None or ev.world == 0 or ev.owner == owner))


def recorded_worlds(world: int | None, all_threads: bool) -> tuple[int | None, int | None]:
    """``(world, owner)`` a recorder keeps (see ``selected``): ``world``, else the caller's simulated
    world when opened inside one, else the worlds started from the calling thread (every thread's
    with ``all_threads``)."""
    world = current_world() if world is None else world
    return world, None if all_threads or world is not None else threading.get_ident()


def current_world() -> int | None:
    """The id of the simulated world the caller runs in (None outside ``run_spmd``)."""
    t = current_sim_transport()
    return None if t is None else t.world_id


class CommLog:
    """Collects the ``CommEvent``s of every rank (or of one ``rank``) while active.

    Opened inside a simulated rank it keeps only that world's events; opened outside, the events
    of the worlds started from the thread that opened it (``run_spmd`` calls made there), each
    tagged with its ``world``, and torch.distributed's.  So two test threads each running their
    own worlds never see each other's collectives.  ``world=`` picks one world explicitly;
    ``all_threads=True`` keeps the worlds of every thread of the process.
    """

    def __init__(self, rank: int | None = None, world: int | None = None, all_threads: bool = False) -> None:
        self.events: list[CommEvent] = []
        self.rank = rank
        self.world, self.owner = recorded_worlds(world, all_threads)
        self._lock = threading.Lock()

    def _on(self, ev: CommEvent) -> None:
        if not selected(ev, self.rank, self.world, self.owner):
            return
        with self._lock:
            self.events.append(ev)

    def __enter__(self) -> "CommLog":
        add_listener(self._on)
        return self

    def __exit__(self, *exc: object) -> None:
        remove_listener(self._on)

    def of_rank(self, rank: int) -> list[CommEvent]:
        return [e for e in self.events if e.rank == rank]

    def clear(self) -> None:
        with self._lock:
            self.events.clear()


_single = threading.local()
_dist: tuple[object, Transport] | None = None
_dists: dict[int, tuple[object, Transport]] = {}  # by id of torch.distributed's default group


def current_transport() -> Transport:
    """The transport of the calling rank: simulated rank, torch.distributed, or a world of one."""
    global _dist
    t = current_sim_transport()
    if t is not None:
        return t
    import torch.distributed as dist

    world = dist.group.WORLD
    if _dist is not None and _dist[0] is world:  # the common case first: the same world as before
        return _dist[1]
    if dist.is_available() and dist.is_initialized():  # another world: a new one, or another thread's
        seen = _dists.get(id(world))  # torch's threaded test worlds give each thread (rank) its own
        if seen is None or seen[0] is not world:
            from .torchdist import TorchDistTransport

            if len(_dists) >= 256:  # worlds of finished tests: drop the oldest
                del _dists[next(iter(_dists))]
            seen = _dists[id(world)] = (world, TorchDistTransport())
        _dist = seen
        return seen[1]
    t = getattr(_single, "t", None)
    if t is None:
        t = _single.t = SimTransport(SimWorld(1), 0)
    return t


def record(kind: str, mesh_dim: MeshDims, group: Group, rank: int, sent: int, received: int,
           dtype: torch.dtype, shape: tuple[int, ...], seconds: float, backend: str, world: int = 0,
           owner: int = 0) -> None:
    """The recording point: hand one event to every listener (cheap when there are none)."""
    if not _listeners:
        return
    ev = CommEvent(kind, rank, mesh_dim, group, int(sent), int(received), dtype, tuple(shape), seconds, backend,
                   current_scope(), time.time() - seconds, world, owner)
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        fn(ev)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes(kind: str, t: torch.Tensor, k: int) -> int:
    """Bytes one rank sends (and receives) in a ring collective over ``k`` ranks."""
    n = _nbytes(t)
    return {"all_gather": (k - 1) * n, "all_reduce": 2 * (k - 1) * n // k}.get(kind, (k - 1) * n // k)


def issue(kind: str, group: Group, mesh_dim: MeshDims, t: torch.Tensor, extra: tuple = (),
          async_op: bool = False) -> Any:
    """Run one data collective on the calling rank's transport and record it.

    ``kind`` is all_gather, all_reduce, reduce_scatter or all_to_all; ``extra`` holds the
    reduce op of the reducing ones.
    """
    return _recorded(kind, group, mesh_dim, t, None, None,
                     lambda tr, a: getattr(tr, kind)(t, *extra, group, async_op=a), async_op)


def _recorded(kind: str, group: Group, mesh_dim: MeshDims, t: torch.Tensor, sent: int | None,
              received: int | None, call: Callable[[Transport, bool], Any], async_op: bool = False) -> Any:
    """``call(transport, async_op)`` on the calling rank's transport, reported to the listeners
    when complete (at ``wait()`` for async work).  The one place a transport is called from.
    ``sent``/``received`` of ``None``: the ring model's bytes of ``kind`` on ``t`` (worked out
    only when someone listens)."""
    tr = current_transport()
    if len(group) == 1:
        out = call(tr, False)
        return Completed(out) if async_op else out
    t0 = time.perf_counter()

    def done(out: Any) -> Any:
        if _listeners:
            ring = _bytes(kind, t, len(group))
            record(kind, mesh_dim, group, tr.rank, ring if sent is None else sent,
                   ring if received is None else received, t.dtype, tuple(t.shape), time.perf_counter() - t0,
                   tr.name, tr.world_id, tr.owner)
        return out

    if async_op:
        return call(tr, True).chain(done)
    return done(call(tr, False))


def tracing(t: torch.Tensor) -> bool:
    """Whether ``t`` belongs to a trace (torch.compile, or fake tensors) rather than to real data."""
    if torch.compiler.is_compiling():
        return True
    if type(t) is torch.Tensor:
        return False
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _collective(kind: str, t: torch.Tensor, mesh: "DeviceMesh", mesh_dim: MeshDims, extra: tuple = (),
                async_op: bool = False) -> Any:
    group = mesh.group_ranks(mesh_dim)
    if tracing(t):  # torch.compile traces: the graph gets an op that runs ``issue``
        from .traced import traced

        out = traced(kind, t, group, mesh_dim, extra)
        return Completed(out) if async_op else out
    return issue(kind, group, mesh_dim, t, extra, async_op)


def all_gather(t: torch.Tensor, mesh: "DeviceMesh", mesh_dim: MeshDims, async_op: bool = False) -> Any:
    """Stack of every group member's ``t``: shape ``(k, *t.shape)``, group-rank order.

    With ``async_op`` every collective here returns a ``Work`` (recorded when waited on).
    """
    return _collective("all_gather", t, mesh, mesh_dim, (), async_op)


def all_reduce(t: torch.Tensor, op: str, mesh: "DeviceMesh", mesh_dim: MeshDims, async_op: bool = False) -> Any:
    """Element-wise ``op`` over the group (a new tensor)."""
    return _collective("all_reduce", t, mesh, mesh_dim, (op,), async_op)


def reduce_scatter(t: torch.Tensor, op: str, mesh: "DeviceMesh", mesh_dim: MeshDims, async_op: bool = False) -> Any:
    """``t`` is ``(k, *s)``; group rank ``i`` gets ``op`` over every member's block ``i``."""
    return _collective("reduce_scatter", t, mesh, mesh_dim, (op,), async_op)


def all_to_all(t: torch.Tensor, mesh: "DeviceMesh", mesh_dim: MeshDims, async_op: bool = False) -> Any:
    """``t`` is ``(k, *s)``; block ``i`` goes to group rank ``i``; result block ``i`` came from it."""
    return _collective("all_to_all", t, mesh, mesh_dim, (), async_op)


def all_to_all_v(sends: list[torch.Tensor], recv_shapes: list[tuple[int, ...]], mesh: "DeviceMesh",
                 mesh_dim: MeshDims, async_op: bool = False) -> Any:
    """Unpadded all-to-all: ``sends[i]`` goes to group rank ``i``; result ``i`` (of shape
    ``recv_shapes[i]``) came from it.  Blocks may differ in shape; empty ones cost nothing."""
    group = mesh.group_ranks(mesh_dim)
    if any(tracing(x) for x in sends[:1]):
        from .traced import traced_all_to_all_v

        out = traced_all_to_all_v(sends, recv_shapes, group, mesh_dim)
        return Completed(out) if async_op else out
    return issue_all_to_all_v(sends, recv_shapes, group, mesh_dim, async_op)


def issue_all_to_all_v(sends: list[torch.Tensor], recv_shapes: list[tuple[int, ...]], group: Group,
                       mesh_dim: MeshDims, async_op: bool = False) -> Any:
    """``all_to_all_v`` on the calling rank's transport, recorded."""
    me = group.index(current_transport().rank)
    if len(group) == 1:
        out1 = [sends[0].clone()]
        return Completed(out1) if async_op else out1
    es = sends[me].element_size()
    sent = sum(x.numel() for i, x in enumerate(sends) if i != me) * es
    received = sum(math.prod(s) for i, s in enumerate(recv_shapes) if i != me) * es
    return _recorded("all_to_all", group, mesh_dim, sends[me], sent, received,
                     lambda tr, a: tr.all_to_all_v(sends, recv_shapes, group, async_op=a), async_op)


def broadcast(t: torch.Tensor, src: int, mesh: "DeviceMesh", mesh_dim: MeshDims) -> torch.Tensor:
    """Group rank ``src``'s ``t`` on every member (``t`` elsewhere gives only shape and dtype)."""
    group = mesh.group_ranks(mesh_dim)
    if tracing(t):
        from .traced import traced

        return traced("broadcast", t, group, mesh_dim, (src,))
    return issue_broadcast(t, src, group, mesh_dim)


def issue_broadcast(t: torch.Tensor, src: int, group: Group, mesh_dim: MeshDims) -> torch.Tensor:
    """``broadcast`` on the calling rank's transport, recorded."""
    k, me = len(group), group.index(current_transport().rank)
    sent, recv = ((k - 1) * _nbytes(t), 0) if me == src else (0, _nbytes(t))
    return _recorded("broadcast", group, mesh_dim, t, sent, recv, lambda tr, a: tr.broadcast(t, src, group))


def barrier(mesh: "DeviceMesh", mesh_dim: int | None = None) -> None:
    """Wait until every member of the group arrives."""
    group = mesh.group_ranks(mesh_dim)
    mesh.transport.barrier(group)
    record("barrier", mesh_dim, group, mesh.transport.rank, 0, 0, torch.uint8, (), 0.0, mesh.transport.name,
           mesh.transport.world_id, mesh.transport.owner)


@contextmanager
def recording(world: int | None = None, all_threads: bool = False) -> Iterator[CommLog]:
    """``with recording() as log:`` collects the events of every rank of the worlds this thread
    runs (of the caller's simulated world when opened inside one; see ``CommLog``)."""
    with CommLog(world=world, all_threads=all_threads) as log:
        yield log
