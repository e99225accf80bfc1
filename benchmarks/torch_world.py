"""PyTorch's DTensor on simulated ranks: the reference side of the OpInfo sweep.

``runner(mesh_shape, cases, fn, grad, weights)`` has the shape ``opcheck.check`` takes: it runs
the cases on one thread per rank with torch's threaded process group (a test utility inside
torch, used here by the benchmark only, never by shardtensor), builds torch's DTensors from the
same local pieces and Partial terms ``opcheck`` builds for shardtensor, and returns per rank
what ``opcheck`` compares with one device.  A rank's exception is re-raised (so the sweep
classifies it the same way; the ranks that torch's threaded group stops because of it leave with
``SystemExit``, which is not reported); ranks still running after the timeout raise
``TimeoutError``.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial as TPartial, Replicate as TReplicate, Shard as TShard
from torch.distributed.tensor.placement_types import _StridedShard as TStridedShard

import opcheck
from shardtensor import Partial, Replicate, Shard, StridedShard

TIMEOUT = 30.0

logging.getLogger("torch.distributed").setLevel(logging.ERROR)  # per-call advice on every rank


def _theirs(p: Any) -> Any:
    if isinstance(p, Shard):
        return TShard(p.dim)
    if isinstance(p, StridedShard):
        return TStridedShard(p.dim, split_factor=p.split_factor)
    if isinstance(p, Partial):
        return TPartial(p.reduce_op)
    if isinstance(p, Replicate):
        return TReplicate()
    raise TypeError(f"no torch placement for {p!r}")


def _ours(p: Any) -> Any:
    if isinstance(p, TStridedShard):
        return StridedShard(p.dim, int(p.split_factor))
    if isinstance(p, TShard):
        return Shard(p.dim)
    if isinstance(p, TPartial):
        return Partial(p.reduce_op)
    if isinstance(p, TReplicate):
        return Replicate()
    raise TypeError(f"no shardtensor placement for {p!r}")


TORCH = opcheck.Api(
    lambda shape: init_device_mesh("cpu", shape),
    lambda local, mesh, pl, shape, stride: DTensor.from_local(local, mesh, [_theirs(p) for p in pl], run_check=False,
                                                              shape=shape, stride=stride),
    DTensor, lambda o: tuple(_ours(p) for p in o.placements), lambda o: None)


def runner(mesh_shape: tuple, cases: list, fn: Any, grad: bool, weights: Any) -> list:
    """Every rank of ``mesh_shape`` on a thread, in a fresh threaded world."""
    return threaded(math.prod(mesh_shape), lambda: opcheck._rank_run(mesh_shape, cases, fn, grad, weights, TORCH))


def threaded(n: int, body: Any) -> list:
    """``body()`` on ``n`` ranks, each a thread of a fresh torch threaded world; per-rank results."""
    from torch.testing._internal.distributed.multi_threaded_pg import (ProcessLocalGroup, _install_threaded_pg,
                                                                       _uninstall_threaded_pg)

    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    ProcessLocalGroup.reset()
    _install_threaded_pg()
    store = dist.HashStore()

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=n, store=store)
        try:
            results[rank] = body()
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
            errors[rank] = e
            ProcessLocalGroup.exception_handle(e)
        finally:
            try:
                dist.destroy_process_group()
            except AttributeError:  # torch 2.11's threaded world lacks what its own teardown reads
                pass

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(n)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + TIMEOUT  # one deadline for the world: a hung one costs TIMEOUT, not n x
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"PyTorch DTensor: ranks {[r for r, t in enumerate(threads) if t.is_alive()]} "
                           f"still running after {TIMEOUT:.0f} s")
    # ranks stopped by another rank's failure leave with SystemExit: report the failure itself
    real = [e for e in errors if e is not None and not isinstance(e, SystemExit)]
    if real:
        raise real[0]
    if any(e is not None for e in errors):
        raise RuntimeError("PyTorch DTensor: ranks were terminated")
    return results
