"""Run a function in several real ``torch.distributed`` processes (gloo by default).

``run_multiprocess(fn, world_size=4)`` spawns ``world_size`` processes (torch.multiprocessing,
spawn context), initialises the process group on a free localhost port with a timeout, calls
``fn(rank, world_size, *args)`` in each and returns the results in rank order.  A rank that
raises (or dies) makes the parent raise ``MultiprocessError`` with that rank's traceback.  An
overall timeout kills whatever is still running, so a hung collective can never hang the test
session.

``fn`` and its arguments must be picklable: a top-level function of an importable module.
Results travel back pickled (plain ``pickle``: tensors are copied by value, not shared).

``run_multiprocess_outcomes`` runs the same way but returns what happened to every rank
(finished, raised, died, killed at the timeout, and when), for tests about failure handling.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

__all__ = ["MultiprocessError", "RankOutcome", "free_port", "run_multiprocess", "run_multiprocess_outcomes",
           "gloo_available"]


def gloo_available() -> bool:
    try:
        import torch.distributed as dist
    except Exception:  # pragma: no cover - torch without distributed
        return False
    return dist.is_available() and dist.is_gloo_available()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankOutcome:
    """What happened to one rank.

    status: ``"ok"`` (returned ``value``), ``"error"`` (raised; ``error`` is the formatted
    traceback), ``"exited"`` (the process ended without reporting; ``exitcode``), ``"killed"``
    (still running at the overall timeout, or after the grace period that follows another
    rank's failure).  ``seconds``: time from the start of the run until the parent saw it.
    """

    rank: int
    status: str
    value: Any = None
    error: str = ""
    exitcode: int | None = None
    seconds: float = 0.0

    def summary(self) -> str:
        if self.status == "ok":
            return f"rank {self.rank}: ok after {self.seconds:.1f}s"
        if self.status == "error":
            last = self.error.strip().splitlines()[-1] if self.error.strip() else "?"
            return f"rank {self.rank}: raised after {self.seconds:.1f}s: {last}"
        if self.status == "exited":
            return f"rank {self.rank}: process exited with code {self.exitcode} after {self.seconds:.1f}s without reporting"
        return f"rank {self.rank}: killed after {self.seconds:.1f}s (still running)"


class MultiprocessError(RuntimeError):
    """A spawned rank failed; the message holds the failing rank's traceback and a summary."""

    def __init__(self, message: str, outcomes: list[RankOutcome]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


# -- the child ------------------------------------------------------------------------------

def _worker(rank: int, world_size: int, port: int, backend: str, init_timeout: float,
            fn: Callable[..., Any], args: tuple, q: Any) -> None:
    """Entry point of each spawned process; always ends the process with ``os._exit``."""
    ok = False
    try:
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=init_timeout))
        value = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps(value)
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"result of {getattr(fn, '__name__', fn)} on rank {rank} cannot be pickled: {e}") from e
        q.put((rank, "ok", payload))
        ok = True
    except BaseException:  # noqa: BLE001 - report everything, SystemExit included
        try:
            q.put((rank, "error", traceback.format_exc()))
        except Exception:  # noqa: BLE001
            pass
    finally:
        try:
            q.close()
            q.join_thread()  # the message is in the pipe before the process ends
        except Exception:  # noqa: BLE001
            pass
    if ok:
        # Every rank finished its work: meet once more so no rank closes its connections while
        # a peer still reads the last collective, then tear down cleanly.
        try:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    # On failure: end at once, closing every connection, as an uncaught exception would under
    # torchrun.  No destroy_process_group: it must not wait for peers that are stuck.
    os._exit(0 if ok else 1)


# -- the parent -----------------------------------------------------------------------------

@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """Set environment variables while the children start (spawned children inherit them)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _child_env(env: dict[str, str] | None, comm_timeout: float) -> dict[str, str]:
    out = {"OMP_NUM_THREADS": "1", "SHARDTENSOR_COMM_TIMEOUT": f"{comm_timeout:g}"}
    try:
        if "GLOO_SOCKET_IFNAME" not in os.environ and any(n == "lo" for _, n in socket.if_nameindex()):
            out["GLOO_SOCKET_IFNAME"] = "lo"
    except OSError:  # pragma: no cover
        pass
    out.update(env or {})
    return out


def run_multiprocess_outcomes(fn: Callable[..., Any], world_size: int = 4, timeout: float = 60, backend: str = "gloo",
                              args: Sequence[Any] = (), *, env: dict[str, str] | None = None,
                              init_timeout: float | None = None, fail_fast_grace: float | None = None,
                              ) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; every rank's outcome.

    ``timeout``: overall seconds; whatever still runs then is killed.  ``env``: extra
    environment for the children, set before they import anything (defaults:
    ``OMP_NUM_THREADS=1``, ``SHARDTENSOR_COMM_TIMEOUT`` = half the timeout, capped at 30 s).
    ``init_timeout``: the timeout given to ``init_process_group`` (default: the comm timeout,
    at least 30 s, so slow process start-up on a loaded machine does not fail the rendezvous).
    ``fail_fast_grace``: once a rank fails, the others get this many seconds to end by
    themselves before they are killed; ``None`` waits for them until ``timeout``.
    """
    import torch.multiprocessing as tmp

    env = dict(env or {})
    comm_timeout = float(env.get("SHARDTENSOR_COMM_TIMEOUT", min(30.0, max(5.0, timeout / 2))))
    env = _child_env(env, comm_timeout)
    init_timeout = max(comm_timeout, 30.0) if init_timeout is None else float(init_timeout)

    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = []
    start = time.monotonic()
    with _environ(env):
        for rank in range(world_size):
            p = ctx.Process(target=_worker, args=(rank, world_size, port, backend, init_timeout, fn, tuple(args), q),
                            daemon=True, name=f"rank{rank}")
            p.start()
            procs.append(p)

    outcomes: dict[int, RankOutcome] = {}
    exited_at: dict[int, float] = {}
    deadline = start + timeout
    first_failure: float | None = None
    try:
        while len(outcomes) < world_size:
            now = time.monotonic()
            limit = deadline
            if first_failure is not None and fail_fast_grace is not None:
                limit = min(limit, first_failure + fail_fast_grace)
            if now >= limit:
                break
            try:
                rank, status, payload = q.get(timeout=min(0.1, max(0.0, limit - now)))
            except queue_mod.Empty:
                pass
            else:
                t = time.monotonic() - start
                if status == "ok":
                    outcomes[rank] = RankOutcome(rank, "ok", value=pickle.loads(payload), seconds=t)
                else:
                    outcomes[rank] = RankOutcome(rank, "error", error=payload, seconds=t)
                    if first_failure is None:
                        first_failure = time.monotonic()
                continue
            # processes that ended without a message (os._exit, a signal, a crash in C code);
            # a message already in the pipe gets half a second to arrive first
            for rank, p in enumerate(procs):
                if rank in outcomes or p.exitcode is None:
                    continue
                seen = exited_at.setdefault(rank, time.monotonic())
                if time.monotonic() - seen > 0.5:
                    outcomes[rank] = RankOutcome(rank, "exited", exitcode=p.exitcode, seconds=seen - start)
                    if first_failure is None:
                        first_failure = seen
    finally:
        # ranks that reported get a moment to finish their final barrier and exit by themselves
        settle = time.monotonic() + 2.0
        for rank, p in enumerate(procs):
            if p.is_alive() and rank in outcomes:
                p.join(timeout=max(0.0, settle - time.monotonic()))
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        end = time.monotonic() - start
        for rank in range(world_size):
            if rank not in outcomes:
                outcomes[rank] = RankOutcome(rank, "killed", exitcode=procs[rank].exitcode, seconds=end)
        q.close()
        q.cancel_join_thread()
    return [outcomes[r] for r in range(world_size)]


def run_multiprocess(fn: Callable[..., Any], world_size: int = 4, timeout: float = 60, backend: str = "gloo",
                     args: Sequence[Any] = (), *, env: dict[str, str] | None = None, init_timeout: float | None = None,
                     fail_fast_grace: float | None = 5.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; results in rank order.

    Raises ``MultiprocessError`` naming the first rank that failed, with its traceback and a
    line per rank; ``TimeoutError`` (a ``MultiprocessError`` too) when ranks were still running
    at ``timeout``.  See ``run_multiprocess_outcomes`` for the keywords.
    """
    for attempt in range(2):
        outcomes = run_multiprocess_outcomes(fn, world_size, timeout, backend, args, env=env,
                                             init_timeout=init_timeout, fail_fast_grace=fail_fast_grace)
        if attempt == 0 and any(_port_taken(o.error) for o in outcomes):
            continue  # another process took the free port before rank 0 bound it: once more
        break
    if all(o.status == "ok" for o in outcomes):
        return [o.value for o in outcomes]
    failed = sorted((o for o in outcomes if o.status in ("error", "exited")), key=lambda o: o.seconds)
    summary = "\n".join("  " + o.summary() for o in outcomes)
    name = getattr(fn, "__qualname__", repr(fn))
    if not failed:
        raise _MultiprocessTimeout(
            f"{name}: ranks still running after the {timeout:g}s timeout were killed\n{summary}", outcomes)
    first = failed[0]
    detail = first.error if first.status == "error" else f"process exited with code {first.exitcode}\n"
    others = "".join(f"\n--- rank {o.rank} ---\n{o.error}" for o in failed[1:] if o.status == "error")
    raise MultiprocessError(f"{name}: rank {first.rank} failed:\n{detail}\nall ranks:\n{summary}"
                            + (f"\n\nother ranks' errors:{others}" if others else ""), outcomes)


def _port_taken(error: str) -> bool:
    e = error.lower()
    return "address already in use" in e or "eaddrinuse" in e


class _MultiprocessTimeout(MultiprocessError, TimeoutError):
    pass
