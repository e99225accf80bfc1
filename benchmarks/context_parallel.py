"""Attention over a sequence sharded on 4 ranks: ring, gather and heads modes vs gathering the sequence.

    python benchmarks/context_parallel.py                       # simulated world, 2k-32k (~6 min)
    python benchmarks/context_parallel.py --world gloo          # 4 gloo processes, 2k-16k
    python benchmarks/context_parallel.py --lengths 2048 --quick

Per sequence length and mode, one causal attention forward and backward of ``(1, heads, L, dim)``
float32 q, k, v sharded on the sequence (``Shard(2)``), each case in a fresh process (so peak
memory is the case's own):

- **bytes**: what one rank receives during the forward (ours: the recorded collectives, max over
  ranks) against the analytic minimum of the mode: ring and gather receive the other ranks' keys
  and values once, (P-1)/P of the K/V bytes; heads receives (P-1)/P of its q, k, v and output
  blocks; hybrid half of those four blocks and its ring's share; gathering the sequence
  receives (P-1)/P of q, k and v.
- **peak MiB / rank**: the process's peak resident memory during the case, above what it held
  before, divided by the ranks it hosts (4 in the simulated world, 1 under gloo).
- **seconds**: forward + backward, wall clock (the simulated world runs its 4 ranks as threads
  on this machine's cores, so this is the sum of the ranks' work more than one rank's time).

Modes: ``ring`` (ours, default), ``gather`` (ours, every block at once: torch's "allgather"
rotation), ``heads`` (all-to-all to heads, torch's fused kernel), ``hybrid`` (the sequence on a
(2, P/2) mesh: all-to-all to heads on the first dim, a ring on the second), ``replicate`` (gather q, k, v
and attend to the whole sequence, as DTensor's sharding rules do for a sequence shard).  Torch's
own ``context_parallel`` needs CUDA and NCCL: it is not on this table.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

MODES = ("ring", "gather", "heads", "hybrid", "replicate")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _inputs(length: int, heads: int, dim: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, length, dim, generator=g) for _ in range(4)]


def _one_rank(mesh, mode: str, q, k, v, dout) -> dict:
    """Forward + backward on this rank; bytes it received in the forward."""
    import torch.nn.functional as F

    import shardtensor as st
    from shardtensor import Replicate, Shard
    from shardtensor.cp.dtensor import sequence_attention

    sequence_attention("ring" if mode == "replicate" else mode)
    if mode == "hybrid":  # the sequence on both dims of a (2, P/2) mesh: heads on the first, a ring on the second
        mesh = st.init_device_mesh("cpu", (2, mesh.size() // 2))
    seq = [Shard(2)] * mesh.ndim
    leaves = [st.distribute_tensor(t, mesh, seq).requires_grad_() for t in (q, k, v)]
    t0 = time.perf_counter()
    with st.CommTrace(rank=mesh.get_rank()) as trace:
        if mode == "replicate":
            whole = [t.redistribute(mesh, [Replicate()]) for t in leaves]
            out = F.scaled_dot_product_attention(*whole, is_causal=True).redistribute(mesh, seq)
        else:
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    received = sum(e.bytes_received for e in trace.events)
    out.backward(st.distribute_tensor(dout, mesh, seq))
    return {"received": received, "seconds": time.perf_counter() - t0}


def _minimum(mode: str, length: int, heads: int, dim: int, ranks: int) -> int:
    """The mode's analytic bytes received by the rank with the smallest piece (float32)."""
    block = heads * dim * 4  # one position of one tensor
    piece = length // ranks
    if mode in ("ring", "gather"):
        return 2 * (length - piece) * block
    if mode == "heads":
        return 4 * (ranks - 1) * piece * block // ranks
    if mode == "hybrid":  # all-to-all over 2 ranks, then a ring over ranks / 2
        return 4 * piece * block // 2 + 2 * (ranks // 2 - 1) * piece * block
    return 3 * (length - piece) * block


def case(world: str, mode: str, length: int, heads: int, dim: int, ranks: int) -> dict:
    """One case in this process (the child of ``main``)."""
    q, k, v, dout = _inputs(length, heads, dim)
    before = _rss_mib()
    if world == "sim":
        import shardtensor as st

        res = st.run_spmd(lambda: _one_rank(st.init_device_mesh("cpu", (ranks,)), mode, q, k, v, dout), ranks)
        peak = (_peak_mib() - before) / ranks
    else:
        from distributed import run_multiprocess

        res = run_multiprocess(_gloo_rank, ranks, timeout=900, args=(mode, length, heads, dim))
        peak = max(r["peak"] for r in res)
    return {"received": max(r["received"] for r in res), "seconds": max(r["seconds"] for r in res), "peak": peak,
            "minimum": _minimum(mode, length, heads, dim, ranks)}


def _gloo_rank(rank: int, world_size: int, mode: str, length: int, heads: int, dim: int) -> dict:
    import shardtensor as st

    q, k, v, dout = _inputs(length, heads, dim)
    before = _rss_mib()
    res = _one_rank(st.init_device_mesh("cpu", (world_size,)), mode, q, k, v, dout)
    return {**res, "peak": _peak_mib() - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", choices=("sim", "gloo"), default="sim")
    ap.add_argument("--lengths", default="")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--quick", action="store_true", help="2k and 4k only")
    ap.add_argument("--case", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        print(json.dumps(case(a.world, a.case[0], int(a.case[1]), a.heads, a.dim, a.ranks)))
        return
    default = "2048,4096" if a.quick else ("2048,4096,8192,16384,32768" if a.world == "sim" else "2048,4096,8192")
    lengths = [int(x) for x in (a.lengths or default).split(",")]
    print(f"causal attention fwd+bwd, (1, {a.heads}, L, {a.dim}) float32, sequence on {a.ranks} ranks, "
          f"world={a.world}, {time.strftime('%Y-%m-%d')}\n")
    print("| L | mode | bytes received / rank | analytic minimum | ratio | peak MiB / rank | seconds |")
    print("|---|---|---|---|---|---|---|")
    for length in lengths:
        for mode in a.modes.split(","):
            cmd = [sys.executable, __file__, "--world", a.world, "--heads", str(a.heads), "--dim", str(a.dim),
                   "--ranks", str(a.ranks), "--case", mode, str(length)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ,
                                  "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
            if done.returncode:
                print(f"| {length} | {mode} | failed: {done.stderr.strip().splitlines()[-1:]} | | | | |")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"| {length} | {mode} | {r['received']:,} | {r['minimum']:,} | {r['received'] / r['minimum']:.2f} "
                  f"| {r['peak']:.0f} | {r['seconds']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
