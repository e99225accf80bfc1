"""The recording point: every collective runs here, on the calling rank's transport, and is reported.

Each run hands a ``CommEvent`` (kind, mesh dim, group, bytes sent and received by this rank under
the ring model, dtype, time) to every listener; ``CommLog`` and ``recording()`` collect them per
world.  The functions here take a group of global ranks; ``shardtensor.comm``'s collectives take a
mesh and a mesh dim and call these (directly, or through the ops a compiled graph holds).
"""
from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .base import Completed, Group, MeshDims, Transport
from .simulated import SimTransport, SimWorld, current_sim_transport

__all__ = [
    "CommEvent", "CommLog", "MeshDims", "add_listener", "remove_listener", "record", "current_transport", "scope",
    "listening", "current_scope", "recording", "current_world", "selected", "recorded_worlds", "issue",
    "issue_all_to_all_v", "issue_broadcast", "issue_send_recv", "tracing",
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


def issue_broadcast(t: torch.Tensor, src: int, group: Group, mesh_dim: MeshDims) -> torch.Tensor:
    """``broadcast`` on the calling rank's transport, recorded."""
    k, me = len(group), group.index(current_transport().rank)
    sent, recv = ((k - 1) * _nbytes(t), 0) if me == src else (0, _nbytes(t))
    return _recorded("broadcast", group, mesh_dim, t, sent, recv, lambda tr, a: tr.broadcast(t, src, group))


def issue_send_recv(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
    """``send_recv`` on the calling rank's transport, recorded as one ``send_recv`` event whose
    group is this rank followed by its peers."""
    tr = current_transport()
    peers = tuple(sorted({p for p, _ in sends} | {p for p, _ in recvs}))
    if not peers:
        return
    t0 = time.perf_counter()
    tr.send_recv(sends, recvs)
    if _listeners:
        sent, got = sum(_nbytes(t) for _, t in sends), sum(_nbytes(b) for _, b in recvs)
        ref = (sends or recvs)[0][1]
        record("send_recv", None, (tr.rank,) + peers, tr.rank, sent, got, ref.dtype, (max(sent, got),),
               time.perf_counter() - t0, tr.name, tr.world_id, tr.owner)


@contextmanager
def recording(world: int | None = None, all_threads: bool = False) -> Iterator[CommLog]:
    """``with recording() as log:`` collects the events of every rank of the worlds this thread
    runs (of the caller's simulated world when opened inside one; see ``CommLog``)."""
    with CommLog(world=world, all_threads=all_threads) as log:
        yield log
