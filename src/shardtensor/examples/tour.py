"""``shardtensor tour``: a guided tour of placements, redistribution and elementwise ops.

Runs on a (2, 2) mesh of 4 ranks -- in the simulated world by default, or in real processes
when started under ``torchrun --nproc-per-node 4``.  Each step prints the placements, every
rank's local shape, the collectives it used with their bytes, and a check against the dense
tensor computed on one device.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardtensor import comm
from shardtensor.mesh import init_device_mesh
from shardtensor.placement import Partial, Replicate, Shard, display
from shardtensor.tensor import DTensor, distribute_tensor


@dataclass
class StepResult:
    name: str
    placements: str
    local_shape: tuple[int, ...]
    collectives: list[tuple[str, Any, int, int]]
    ok: bool


def _tour(rank_results: list[StepResult]) -> list[StepResult]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = mesh.get_rank()
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(7, 5, generator=g)
    bias = torch.randn(5, generator=g)
    out: list[StepResult] = []

    def step(name: str, fn: Callable[[], Any], expect: Any) -> Any:
        with comm.CommLog(rank=rank) as log:
            t = fn()
        with comm.CommLog(rank=-1):
            ok = torch.allclose(t.full_tensor(), expect, atol=1e-6)
        colls = [(e.kind, e.mesh_dim, e.group_size, e.bytes_sent) for e in log.events]
        out.append(StepResult(name, display(t.placements, t.shard_order), tuple(t.to_local().shape), colls, ok))
        return t

    x = step("distribute (7,5) as (S0, S1)", lambda: distribute_tensor(dense, mesh, [Shard(0), Shard(1)]), dense)
    y = step("redistribute -> (S1, S0)", lambda: x.redistribute(mesh, [Shard(1), Shard(0)]), dense)
    z = step("redistribute -> (R, S0)", lambda: y.redistribute(mesh, [Replicate(), Shard(0)]), dense)
    n = step("nested (S0, S0), order tp first", lambda: z.redistribute(mesh, [Shard(0), Shard(0)], shard_order={0: [1, 0]}), dense)
    b = distribute_tensor(bias, mesh, [Replicate(), Replicate()])
    a = step("relu(x * 2 + bias)  [elementwise]", lambda: (n * 2 + b).relu(), (dense * 2 + bias).relu())
    terms = torch.randn(7, 5, generator=torch.Generator().manual_seed(100 + rank))
    total = sum(torch.randn(7, 5, generator=torch.Generator().manual_seed(100 + r)) for r in range(4))
    p = step("from_local Partial(sum) terms", lambda: DTensor.from_local(terms, mesh, [Partial(), Partial()]), total)
    q = step("p * 3 + p  [stays Partial]", lambda: p * 3 + p, total * 4)
    step("reduce -> (S0, R)  [reduce-scatter + all-reduce]", lambda: q.redistribute(mesh, [Shard(0), Replicate()]), total * 4)
    step("full -> (R, R)", lambda: a.redistribute(mesh, [Replicate(), Replicate()]), (dense * 2 + bias).relu())
    return out


def _fmt_bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB"


def print_report(per_rank: list[list[StepResult]], world: str, seconds: float) -> bool:
    """Print one block per step; True when every rank's value matched the dense tensor."""
    print(f"shardtensor tour -- mesh (2, 2) ('dp', 'tp'), 4 ranks, {world}\n")
    all_ok = True
    for i, first in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        ok = all(r.ok for r in rows)
        all_ok &= ok
        print(f"[{i + 1}] {first.name}")
        print(f"    placements   {first.placements}")
        print("    local shapes " + "  ".join(f"r{r}:{tuple(x.local_shape)}" for r, x in enumerate(rows)))
        if first.collectives:
            for kind, dim, k, sent in first.collectives:
                where = "whole mesh" if dim is None else f"mesh dim {dim}"
                print(f"    collective   {kind:<15} {where}, group of {k}, {_fmt_bytes(sent)} sent per rank (rank 0)")
        else:
            print("    collective   none (local)")
        print(f"    check        {'matches dense' if ok else 'MISMATCH vs dense'}\n")
    print(f"{'all steps match the dense tensor' if all_ok else 'SOME STEPS DIFFER FROM DENSE'} ({seconds:.2f} s)")
    return all_ok


def main(backend: str = "sim") -> int:
    """Entry of ``shardtensor tour``; exit code 0 when every check passes."""
    t0 = time.perf_counter()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        results = _tour([])
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results)
        ok = True
        if dist.get_rank() == 0:
            ok = print_report(gathered, f"torch.distributed ({dist.get_backend()})", time.perf_counter() - t0)
        dist.destroy_process_group()
        return 0 if ok else 1
    from shardtensor.comm import run_spmd

    per_rank: list[Any] = run_spmd(_tour, 4, [])
    return 0 if print_report(per_rank, "simulated world (one process)", time.perf_counter() - t0) else 1
