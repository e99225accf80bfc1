"""Moving a state dict between meshes: shardtensor's point-to-point plan vs what RL frameworks do.

    python benchmarks/transfer.py                 # simulated world and 8 gloo processes (~1 min)
    python benchmarks/transfer.py --world sim     # simulated world only
    python benchmarks/transfer.py --mib 8 --iters 3

A state dict of ``--tensors`` fp32 matrices (``--mib`` MiB in all) lives on a trainer mesh: FSDP x TP,
``(2, 2)`` ("dp", "tp") on ranks 0-3, each weight ``(Shard(0), Shard(1))``.  It moves, every
iteration, to

  * ``disjoint``: inference TP on ranks 4-7, ``(4,)``, ``Shard(0)``;
  * ``same ranks``: a ``(2, 2)`` ("replica", "tp") mesh ``[[0, 2], [1, 3]]`` on ranks 0-3,
    ``(Replicate(), Shard(1))`` (two TP replicas of two ranks each, laid out across the trainer's).

Three ways, each checked exact against the dense weights on every destination rank:

  * ``ours``: ``shardtensor.transfer`` (one plan, one bucketed point-to-point exchange);
  * ``gather+bcast``: the trainer's first rank gathers every weight whole, then sends the whole
    weight to every destination rank, which keeps its shard (gather to one rank, then broadcast);
  * ``gather+scatter``: the same gather, then the first rank sends each destination rank only its
    shard.

Both baselines run as two moves through a one-rank mesh (``redistribute`` to ``DeviceMesh([0])``
and on), so they use the same transport as ours.  Columns: bytes sent by the busiest rank, total
bytes on the wire (``send_recv`` events of ``shardtensor.comm.recording()``), and the median wall
time of ``--iters`` iterations (slowest rank), with ratios baseline / ours.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gloo_setup  # noqa: E402,F401  (src/ and tests/ on the path)

import torch  # noqa: E402

from shardtensor import DeviceMesh, Replicate, Shard, comm, distribute_tensor, run_spmd, transfer  # noqa: E402

SCENARIOS = {
    "disjoint": ([4, 5, 6, 7], [Shard(0)]),
    "same ranks": ([[0, 2], [1, 3]], [Replicate(), Shard(1)]),
}


def _dense(tensors: int, mib: float) -> dict[str, torch.Tensor]:
    n = int((mib * 2**20 / 4 / tensors) ** 0.5) // 4 * 4
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randint(-8, 9, (n, n), generator=g).float() for i in range(tensors)}


def _via_one_rank(src: dict, dst_mesh: DeviceMesh, pl: list, scatter: bool) -> dict:
    """Gather every weight on the trainer's first rank, then broadcast (whole) or scatter (shards)."""
    first = DeviceMesh("cpu", [0])
    whole = transfer(src, first, [Replicate()])
    if scatter:
        return transfer(whole, dst_mesh, pl)
    full = transfer(whole, dst_mesh, [Replicate()] * dst_mesh.ndim)
    return {k: v.redistribute(dst_mesh, pl) for k, v in full.items()}  # Replicate -> Shard: a local slice


def _rank_body(scenario: str, tensors: int, mib: float, iters: int) -> dict:
    dst_ranks, pl = SCENARIOS[scenario]
    trainer = DeviceMesh("cpu", [[0, 1], [2, 3]])
    dst_mesh = DeviceMesh("cpu", dst_ranks)
    dense = _dense(tensors, mib)
    src = {k: distribute_tensor(v, trainer, [Shard(0), Shard(1)]) for k, v in dense.items()}
    ways = {"ours": lambda: transfer(src, dst_mesh, pl),
            "gather+bcast": lambda: _via_one_rank(src, dst_mesh, pl, False),
            "gather+scatter": lambda: _via_one_rank(src, dst_mesh, pl, True)}
    world = DeviceMesh("cpu", list(range(8)))
    me = comm.current_transport().rank
    out: dict = {}
    for name, way in ways.items():
        with comm.CommLog(rank=me) as log:
            moved = way()
        ok = all(torch.equal(v.full_tensor(), dense[k]) for k, v in moved.items()) \
            if dst_mesh.get_coordinate() is not None else True
        sent = sum(e.bytes_sent for e in log.events)
        times = []
        for _ in range(iters):
            comm.barrier(world)
            t0 = time.perf_counter()
            way()
            dt = torch.tensor([time.perf_counter() - t0])
            times.append(comm.all_reduce(dt, "max", world, None).item())
        out[name] = (ok, sent, statistics.median(times))
    return out


def _gloo_rank(rank: int, world: int, scenario: str, tensors: int, mib: float, iters: int) -> dict:
    torch.set_num_threads(1)
    return _rank_body(scenario, tensors, mib, iters)


def _table(title: str, per_rank: list[dict]) -> bool:
    print(f"\n{title}")
    print(f"  {'way':<16}{'busiest sender':>16}{'total bytes':>14}{'time (ms)':>11}   ratios vs ours (busiest, total, time)")
    ours = None
    ok_all = True
    for name in per_rank[0]:
        ok = all(r[name][0] for r in per_rank)
        ok_all &= ok
        busiest = max(r[name][1] for r in per_rank)
        total = sum(r[name][1] for r in per_rank)
        t = per_rank[0][name][2] * 1e3
        if ours is None:
            ours = (busiest, total, t)
        ratio = f"{busiest / ours[0]:.2f}x  {total / ours[1]:.2f}x  {t / ours[2]:.2f}x"
        print(f"  {name:<16}{busiest:>16,}{total:>14,}{t:>11.1f}   {ratio}{'' if ok else '   WRONG VALUES'}")
    return ok_all


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", choices=["sim", "gloo", "both"], default="both")
    ap.add_argument("--mib", type=float, default=32.0)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    ok = True
    print(f"state dict: {a.tensors} fp32 matrices, {a.mib:g} MiB; trainer (2, 2) FSDP x TP on ranks 0-3, "
          "(Shard(0), Shard(1))")
    for scenario, (ranks, pl) in SCENARIOS.items():
        what = f"-> {scenario}: mesh {ranks} {pl}"
        if a.world in ("sim", "both"):
            ok &= _table(f"simulated world, {what}", run_spmd(_rank_body, 8, scenario, a.tensors, a.mib, a.iters))
        if a.world in ("gloo", "both"):
            res = _gloo_setup.run_multiprocess(_gloo_rank, world_size=8, timeout=600,
                                               args=(scenario, a.tensors, a.mib, a.iters),
                                               env={"OMP_NUM_THREADS": "1"})
            ok &= _table(f"8 gloo processes, {what}", res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
