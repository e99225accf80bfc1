"""The examples' gloo runs: ``world`` spawned processes on localhost, one result per rank."""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch

from .. import comm

__all__ = ["spawn_gloo", "run_example"]


def _rank(rank: int, world: int, port: int, target: Callable[..., Any], args: tuple, q: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        q.put((rank, target(rank, *args), None))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        q.put((rank, None, repr(e)))
    finally:
        dist.destroy_process_group()


def spawn_gloo(target: Callable[..., Any], world: int, args: tuple = (), timeout: float = 300) -> list[Any]:
    """``target(rank, *args)`` in ``world`` gloo processes (a top-level function: it is pickled);
    the results in rank order, or a ``RuntimeError`` naming the first rank that failed."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, target, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, res, err = q.get(timeout=timeout)
            if err is not None:
                raise RuntimeError(f"rank {rank} failed: {err}")
            out[rank] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def _call(rank: int, fn: Callable[..., Any], args: tuple) -> Any:
    return fn(*args)


def run_example(name: str, run_rank: Callable[..., Any], report: Callable[[list, str], bool], world: int,
                backend: str, args: tuple = (), timeout: float | None = None) -> int:
    """An example's ``main`` (exit code 0 when ``report`` says so): under torchrun (``RANK`` and
    ``WORLD_SIZE`` set) each process runs ``run_rank(*args)`` and rank 0 reports every rank's
    result; ``backend="gloo"`` spawns ``world`` gloo processes; else the simulated world."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        if dist.get_world_size() != world:
            raise SystemExit(f"{name} runs on {world} ranks: torchrun --nproc-per-node {world}")
        rows: list = [None] * world
        dist.all_gather_object(rows, run_rank(*args))
        ok = report(rows, "torchrun, gloo") if dist.get_rank() == 0 else True
        dist.destroy_process_group()
        return 0 if ok else 1
    if backend == "gloo":
        return 0 if report(spawn_gloo(_call, world, (run_rank, args)), f"{world} gloo processes") else 1
    return 0 if report(comm.run_spmd(run_rank, world, *args, timeout=timeout), "simulated world") else 1
