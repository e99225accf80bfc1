"""The simulated world: every rank is a thread of one process; collectives meet in memory.

``run_spmd(fn, world_size)`` runs ``fn`` once per rank and returns the results in rank order.
Ranks rendezvous per (group, call number); a failing rank marks the world failed, every
waiting rank wakes and raises, and the caller gets the first real error, naming its rank.
"""
from __future__ import annotations

import functools
import itertools
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections import defaultdict
from typing import Any, Callable

import torch

from ..errors import CollectiveMismatchError, CollectiveTimeoutError, RankAbortedError, StuckRanksError
from .base import DEFAULT_TIMEOUT_S, Completed, Group, Transport, Work, reduce_stack
from .generators import rank_generators


class _Slot:
    __slots__ = ("kind", "data", "count", "readers", "arrived")

    def __init__(self, kind: str, n: int) -> None:
        self.kind = kind
        self.data: list[Any] = [None] * n
        self.arrived = [False] * n
        self.count = 0
        self.readers = 0


_WORLD_IDS = itertools.count(1)


class SimWorld:
    """Shared state of one simulated world: rendezvous slots and the failure flag."""

    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.timeout = timeout
        self.id = next(_WORLD_IDS)
        self.owner = threading.get_ident()  # the thread that started it (recordings opened there see it)
        self.cond = threading.Condition()
        self.slots: dict[tuple, _Slot] = {}
        self.failed_rank: int | None = None
        self.failed_at = 0.0

    def fail(self, rank: int) -> None:
        with self.cond:
            if self.failed_rank is None:
                self.failed_rank = rank
                self.failed_at = time.monotonic()
            self.cond.notify_all()


class SimTransport(Transport):
    """One rank of a ``SimWorld``."""

    name = "simulated"

    def __init__(self, world: SimWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.world_id = world.id
        self.owner = world.owner
        self._seq: dict[Group, int] = defaultdict(int)

    def _exchange(self, kind: str, group: Group, payload: Any) -> list[Any]:
        """Deposit ``payload`` and return every group member's payload, in group order."""
        if len(group) == 1:
            return [payload]
        key = self._next_key(group)
        deadline = time.monotonic() + self.world.timeout
        with self.world.cond:
            return self._collect_locked(key, group, self._deposit_locked(kind, key, group, payload), deadline)

    def _next_key(self, group: Group) -> tuple:
        key = (group, self._seq[group])
        self._seq[group] += 1
        return key

    def _deposit_locked(self, kind: str, key: tuple, group: Group, payload: Any) -> _Slot:
        w = self.world
        n = len(group)
        slot = w.slots.get(key)
        if slot is None:
            slot = w.slots[key] = _Slot(kind, n)
        elif slot.kind != kind:  # the ranks left SPMD order: fail now rather than mix payloads
            first = group[slot.arrived.index(True)]
            raise CollectiveMismatchError(
                f"rank {self.rank} called {kind} where rank {first} called {slot.kind} "
                f"(collective #{key[1]} over ranks {group}); every rank of a group must issue the same "
                "collectives in the same order")
        i = group.index(self.rank)
        slot.data[i] = payload
        slot.arrived[i] = True
        slot.count += 1
        if slot.count == n:
            w.cond.notify_all()
        return slot

    def _collect_locked(self, key: tuple, group: Group, slot: _Slot, deadline: float) -> list[Any]:
        w = self.world
        n = len(group)
        while slot.count < n:
            if w.failed_rank is not None:
                raise RankAbortedError(f"rank {self.rank}: {slot.kind} over ranks {group} aborted because "
                                       f"rank {w.failed_rank} failed")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r, a in zip(group, slot.arrived) if not a]
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: {slot.kind} #{key[1]} over ranks {group} timed out after "
                    f"{w.timeout:.1f}s: ranks {missing} never arrived ({slot.count}/{n} did). Raise "
                    "run_spmd(timeout=...) or SHARDTENSOR_COMM_TIMEOUT if they were only slow")
            w.cond.wait(min(left, 0.5))
        slot.readers += 1
        if slot.readers == n:
            del w.slots[key]
        return slot.data

    def _work(self, kind: str, group: Group, payload: Any, post: Callable[[list[Any]], torch.Tensor]) -> Work:
        """Deposit ``payload`` now, fixing its place in the group's order; collect at ``wait()``.

        The wait blocks until every member has deposited, under ``_exchange``'s failure and
        timeout rules (the timeout counts from the wait).
        """
        if len(group) == 1:
            return Completed(post([payload]))
        key = self._next_key(group)
        w = self.world
        n = len(group)
        with w.cond:
            slot = self._deposit_locked(kind, key, group, payload)

        def collect() -> list[Any]:
            deadline = time.monotonic() + w.timeout
            with w.cond:
                return self._collect_locked(key, group, slot, deadline)

        return Work(collect, lambda: slot.count >= n, post)

    def _run(self, kind: str, group: Group, payload: Any, post: Callable[[list[Any]], Any], async_op: bool) -> Any:
        """One collective: ``post`` of every member's payload, now or at the ``Work``'s wait."""
        if async_op:
            return self._work(kind, group, payload, post)
        return post(self._exchange(kind, group, payload))

    @staticmethod
    def _own(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone(memory_format=torch.contiguous_format)

    def all_gather(self, t, group, *, async_op=False):
        return self._run("all_gather", group, self._own(t), lambda parts: _stack_same(parts, group), async_op)

    def all_reduce(self, t, op, group, *, async_op=False):
        return self._run("all_reduce", group, self._own(t), lambda parts: _reduce_parts(parts, op, group), async_op)

    def reduce_scatter(self, t, op, group, *, async_op=False):
        me = group.index(self.rank)
        return self._run("reduce_scatter", group, self._own(t),
                         lambda parts: reduce_stack(torch.stack([p[me] for p in parts]), op), async_op)

    def all_to_all(self, t, group, *, async_op=False):
        me = group.index(self.rank)
        return self._run("all_to_all", group, self._own(t), lambda parts: torch.stack([p[me] for p in parts]),
                         async_op)

    def all_to_all_v(self, sends, recv_shapes, group, *, async_op=False):
        me = group.index(self.rank)
        payload = [x.detach().clone() for x in sends]
        return self._run("all_to_all_v", group, payload, lambda parts: [p[me] for p in parts], async_op)

    def broadcast(self, t, src, group):
        parts = self._exchange("broadcast", group, self._own(t) if group.index(self.rank) == src else None)
        return parts[src].clone()

    def barrier(self, group):
        self._exchange("barrier", group, None)

    def send_recv(self, sends, recvs):
        out, into = dict(sends), dict(recvs)
        works = []
        for p in sorted(set(out) | set(into)):  # one two-rank meeting per peer, both sides in rank order
            pair = (min(p, self.rank), max(p, self.rank))
            payload = out[p].detach().clone() if p in out else None
            works.append((p, self._work("send_recv", pair, payload, lambda parts: parts)))
        for p, w in works:
            got = w.wait()[0 if p < self.rank else 1]
            if p in into:
                if got is None or got.numel() != into[p].numel():
                    raise CollectiveMismatchError(
                        f"rank {self.rank} expected {into[p].numel()} elements from rank {p}, which sent "
                        f"{'nothing' if got is None else got.numel()}: the two ranks planned different moves")
                into[p].copy_(got.view_as(into[p]))

    def gather_objects(self, payload: Any) -> list[Any]:
        """Every rank's ``payload`` (any Python object, not copied), in rank order, on every rank."""
        return self._exchange("gather_objects", tuple(range(self.world_size)), payload)


def _reduce_parts(parts: list[torch.Tensor], op: str, group: Group) -> torch.Tensor:
    return reduce_stack(_stack_same(parts, group), op) if len(parts) > 1 else parts[0]


def _stack_same(parts: list[torch.Tensor], group: Group) -> torch.Tensor:
    """The ranks' pieces stacked, or an error naming each rank's shape when they differ: the ranks
    disagree about the global shape (a ``from_local`` of uneven pieces without ``shape=``)."""
    shapes = [tuple(p.shape) for p in parts]
    if len(set(shapes)) > 1:
        per = ", ".join(f"rank {r}: {s}" for r, s in zip(group, shapes))
        raise RuntimeError(f"collective over ranks {group}: the ranks' pieces differ in shape ({per}); the ranks "
                           "disagree about the global shape. If the DTensor came from DTensor.from_local with uneven "
                           "pieces and run_check=False, pass shape= (the global shape) or drop "
                           "run_check=False so from_local gathers the pieces' sizes")
    return torch.stack(parts)


class _Context(threading.local):
    transport: Transport | None = None


_ctx = _Context()


def current_sim_transport() -> Transport | None:
    return _ctx.transport


def _settle_fake_device_guard() -> None:
    """Install, once and before the ranks start, the stand-in CUDA device guard that torch's
    fake tensors install on a machine without a GPU.  torch.compile traces with fake tensors;
    ranks entering them at once would swap that global guard while another uses it (torch 2.11
    CUDA builds crash with a segmentation fault)."""
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure is not None and not torch.cuda.is_available():
        ensure()


SHARED_RANKS = 0
"""How many simulated worlds of more than one rank are running: their ranks are threads that
share dynamo's cache.  ``ON_SHARED`` callbacks hear ``True`` when the first starts and ``False``
when the last ends (``compile.py`` keeps rank-dependent calls out of compiled graphs meanwhile)."""
ON_SHARED: list[Callable[[bool], None]] = []
_SHARED_LOCK = threading.Lock()


def _shared(delta: int) -> None:
    global SHARED_RANKS
    with _SHARED_LOCK:
        before = SHARED_RANKS
        SHARED_RANKS += delta
        if (before == 0) != (SHARED_RANKS == 0):
            for fn in ON_SHARED:
                fn(SHARED_RANKS > 0)


def run_spmd(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` once per rank of a simulated world; return results in rank order.

    Inside ``fn`` the code is ordinary SPMD code: ``init_device_mesh("cpu", (2, 2))`` (or
    ``"cuda"``) builds a mesh over the simulated ranks.  Each rank has its own default random
    generators, copies of the caller's (see :mod:`shardtensor.comm.generators`), and runs its autograd
    backward on its own thread (torch would run every rank's CUDA backward on one shared engine
    thread, where a collective inside backward waits forever for ranks queued behind it).  On
    Python 3.11, ``functools.cached_property`` computes without its shared lock inside simulated
    ranks (as 3.12 does), so a property that runs a collective cannot deadlock the ranks.

    Nothing hangs: a collective waits at most ``timeout`` seconds (default
    ``SHARDTENSOR_COMM_TIMEOUT``, 120) and then fails naming the ranks that never arrived.  If a
    rank raises, the other ranks stop at their next collective and the first error is re-raised
    here with its rank in the message.  A rank still running a few seconds after the world failed,
    or ``timeout`` seconds after another rank returned, is left behind (a daemon thread) and named,
    with the line it is at, in the error.
    """
    if not callable(fn):
        raise TypeError(f"run_spmd needs a callable, got {fn!r}")
    if _ctx.transport is not None:
        raise RuntimeError("run_spmd cannot be nested inside a simulated rank")
    _lock_free_cached_property()
    world = SimWorld(world_size, DEFAULT_TIMEOUT_S if timeout is None else timeout)
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    cpu_state = torch.get_rng_state()  # each rank starts from the caller's generator, as a forked process

    def body(rank: int) -> None:
        _ctx.transport = SimTransport(world, rank)
        try:
            with rank_generators(cpu_state), torch.autograd.set_multithreading_enabled(False):
                results[rank] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = e
            world.fail(rank)
        finally:
            _ctx.transport = None

    _settle_fake_device_guard()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # rank threads + torch's intra-op pool oversubscribe the cores badly
    threads = [threading.Thread(target=body, args=(r,), name=f"shardtensor-rank{r}", daemon=True) for r in range(world_size)]
    if world_size > 1:
        _shared(+1)
    for t in threads:
        t.start()
    try:
        stuck = _join(threads, world)
    finally:
        torch.set_num_threads(old_threads)
        if world_size > 1:
            _shared(-1)
    if errors:
        real = {r: e for r, e in errors.items() if not isinstance(e, RankAbortedError)}
        rank = world.failed_rank if world.failed_rank in real else min(real or errors)
        err = errors[rank]
        _tag_rank(err, rank, world_size)
        if stuck and hasattr(err, "add_note"):
            err.add_note(_stuck_text(threads, stuck, "after the world failed"))
        raise err
    if stuck:
        raise StuckRanksError(_stuck_text(threads, stuck, f"{world.timeout:.1f}s after another rank returned"))
    return results


def _lock_free_cached_property() -> None:
    """Python 3.11's ``functools.cached_property`` holds one lock per property, shared by every
    instance, while it computes.  A simulated rank computing one that runs a collective (torch's
    chunked ``linear_cross_entropy`` backward does) holds that lock while its peers wait on it for
    their own instances: a deadlock.  Python 3.12 dropped the lock; inside simulated ranks this
    does as 3.12 does (installed once, on first ``run_spmd``; other threads keep 3.11's)."""
    cls: Any = functools.cached_property
    if sys.version_info >= (3, 12) or getattr(cls, "_shardtensor_lock_free", False):
        return
    locked = cls.__get__

    def get(self: Any, instance: Any, owner: Any = None) -> Any:
        if instance is None or _ctx.transport is None or self.attrname is None:
            return locked(self, instance, owner)
        cache = getattr(instance, "__dict__", None)
        if cache is None:
            return locked(self, instance, owner)  # raises its error
        val = cache.get(self.attrname, _MISSING)
        if val is _MISSING:
            val = cache[self.attrname] = self.func(instance)
        return val

    cls.__get__ = get
    cls._shardtensor_lock_free = True


_MISSING = object()
_GRACE_S = 5.0
"""How long ranks may run on after the world failed before they are left behind."""


def _join(threads: list[threading.Thread], world: SimWorld) -> list[int]:
    """Wait for the rank threads; return the ranks given up on (see ``run_spmd``)."""
    first_end: float | None = None
    while True:
        alive = [r for r, t in enumerate(threads) if t.is_alive()]
        if not alive:
            return []
        now = time.monotonic()
        if first_end is None and len(alive) < len(threads):
            first_end = now
        if world.failed_rank is not None:
            deadline = world.failed_at + min(world.timeout, _GRACE_S)
        elif first_end is not None:
            deadline = first_end + world.timeout + 1.0  # a waiting peer's own timeout fires first
        else:
            deadline = float("inf")
        if now > deadline:
            return alive
        threads[alive[0]].join(0.05)


def _stuck_text(threads: list[threading.Thread], stuck: list[int], when: str) -> str:
    """Name the ranks left behind and the line each is running."""
    frames = sys._current_frames()
    where = []
    for r in stuck:
        frame = frames.get(threads[r].ident or -1)
        where.append(f"rank {r} at {_where(frame)}")
    return (f"ranks {stuck} were still running {when}, outside any collective ({'; '.join(where)}); "
            "their threads were left behind")


def _where(frame: Any) -> str:
    """The innermost line outside Python's standard library (and the innermost one, if it differs)."""
    if frame is None:
        return "an unknown line"
    stack = traceback.extract_stack(frame)
    std = sysconfig.get_paths()["stdlib"]
    mine = next((f for f in reversed(stack) if not f.filename.startswith(std)), stack[-1])
    text = f"{mine.filename}:{mine.lineno} in {mine.name}"
    inner = stack[-1]
    return text if inner is mine else f"{text}, inside {os.path.basename(inner.filename)}:{inner.lineno} {inner.name}"


def _tag_rank(err: BaseException, rank: int, world_size: int) -> None:
    """Name the failing rank in the error message, keeping the exception's type."""
    err.rank = rank  # type: ignore[attr-defined]
    prefix = f"[rank {rank} of {world_size}] "
    if err.args and isinstance(err.args[0], str) and not err.args[0].startswith("[rank"):
        err.args = (prefix + err.args[0],) + err.args[1:]
    elif not err.args:
        err.args = (prefix.strip(),)
    if hasattr(err, "add_note"):
        err.add_note(f"raised on simulated rank {rank} of {world_size}")
