"""The examples' gloo runs: ``world`` spawned processes on localhost, one result per rank."""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch

__all__ = ["spawn_gloo"]


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
