"""Cost of ``DTensor.from_local`` over real gloo processes: shardtensor vs PyTorch DTensor.

    python benchmarks/from_local_gloo.py [--iters 300]

Four gloo processes on localhost wrap a (1024, 64) fp32 piece as ``Shard(0)``.  shardtensor's
default (no ``shape=``) gathers the pieces' sizes in one small all-gather so uneven pieces get
their real shape and bad ones raise on every rank; ``run_check=False`` and ``shape=`` skip it.
PyTorch's ``run_check=False`` assumes even pieces; its ``run_check=True`` is its checked form.
Each variant runs ``--iters`` calls after a barrier; the time per call is the slowest rank's
mean.  Ratios are against PyTorch's ``run_check=False`` (the communication-free baseline).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from _gloo_setup import run_multiprocess  # noqa: E402  (puts src/ and tests/ on sys.path)

WORLD = 4


def _variants(rank: int):
    """(name, zero-argument call) pairs; every call wraps the same local piece."""
    import torch
    import torch.distributed.tensor as tdt

    import shardtensor as st

    piece = torch.randn(1024, 64)
    ours, theirs = st.init_device_mesh("cpu", (WORLD,)), tdt.init_device_mesh("cpu", (WORLD,))
    shape = (1024 * WORLD, 64)
    return [
        ("torch run_check=False", lambda: tdt.DTensor.from_local(piece, theirs, [tdt.Shard(0)], run_check=False)),
        ("torch run_check=True", lambda: tdt.DTensor.from_local(piece, theirs, [tdt.Shard(0)], run_check=True)),
        ("ours run_check=False", lambda: st.DTensor.from_local(piece, ours, [st.Shard(0)], run_check=False)),
        ("ours shape=", lambda: st.DTensor.from_local(piece, ours, [st.Shard(0)], shape=shape)),
        ("ours default (gathers sizes)", lambda: st.DTensor.from_local(piece, ours, [st.Shard(0)])),
        ("ours run_check=True", lambda: st.DTensor.from_local(piece, ours, [st.Shard(0)], run_check=True)),
    ]


def _worker(rank: int, world: int, iters: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    out: dict[str, float] = {}
    for name, call in _variants(rank):
        for _ in range(10):
            call()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        mean = torch.tensor([(time.perf_counter() - t0) / iters])
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        out[name] = float(mean)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=300)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = run_multiprocess(_worker, world_size=WORLD, timeout=300, args=(a.iters,))[0]
    base = res["torch run_check=False"]
    print(f"{'variant':<30} {'us/call':>9} {'vs torch run_check=False':>26}")
    for name, t in res.items():
        print(f"{name:<30} {t * 1e6:>9.1f} {t / base:>25.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
