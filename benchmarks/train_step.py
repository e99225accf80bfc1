"""Time per training step of the demo model: shardtensor FSDP x TP vs PyTorch FSDP2 + TP, same run.

    python benchmarks/train_step.py              # 4 gloo processes, 3 warm-up + 10 timed steps each
    python benchmarks/train_step.py --quick      # 1 warm-up + 3 timed steps
    python benchmarks/train_step.py --device cuda   # the 4 processes share the GPUs (gloo)

Also times shardtensor with FSDP's prefetch of the next all-gather switched off.

Four gloo processes on localhost (``OMP_NUM_THREADS=1``), mesh (2, 2) = ("dp", "tp").  Both
libraries get the same model (``shardtensor.examples.tiny_lm.TinyLM``, same initial values), the same TP
plan (q/k/v and MLP up column-wise, attention out and MLP down row-wise, head column-wise with a
replicated output), FSDP on dp (each block, then the root), Adam, and the same batches (each dp
rank takes its half).  Per step the time is the slowest rank's (all-reduce MAX), after a barrier;
the table shows the median and the ratio ours / PyTorch (lower is better).  The losses of both
libraries are printed side by side as a correctness check.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _step_loop(model, dp_rank: int, warmup: int, iters: int, device: str):
    """Adam steps on this dp rank's half of each batch; per step the slowest rank's time, and the losses."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardtensor.examples.tiny_lm import BATCH, batch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    half = BATCH // 2
    times, losses = [], []
    for s in range(warmup + iters):
        x, y = (t.to(device)[dp_rank * half:(dp_rank + 1) * half] for t in batch(s, 0))
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        sync()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if s >= warmup:
            times.append(dt.item())
        losses.append(loss.item())
    return times, losses


def _setup(rank: int, device: str) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())


def _rank_ours(rank: int, world: int, warmup: int, iters: int, device: str = "cpu"):
    """shardtensor, with and without FSDP's prefetch of the next all-gather."""
    _setup(rank, device)
    from shardtensor import init_device_mesh
    from shardtensor.fsdp import FSDPModule
    from shardtensor.examples.tiny_lm import build_model, parallelize

    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    m0 = parallelize(build_model(0).to(device), mesh)
    for mod in m0.modules():
        if isinstance(mod, FSDPModule):
            mod.set_modules_to_forward_prefetch([])
            mod.set_modules_to_backward_prefetch([])
    no_prefetch = _step_loop(m0, mesh.get_local_rank("dp"), warmup, iters, device)
    m = parallelize(build_model(0).to(device), mesh)
    return _step_loop(m, mesh.get_local_rank("dp"), warmup, iters, device), no_prefetch


def _rank_torch(rank: int, world: int, warmup: int, iters: int, device: str = "cpu"):
    """PyTorch FSDP2 + TP with the same plan (its own processes: on gloo + CUDA it may crash)."""
    _setup(rank, device)
    from torch.distributed.device_mesh import init_device_mesh as t_mesh
    from torch.distributed.fsdp import fully_shard as t_fully_shard
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor.parallel import ColwiseParallel as TC, RowwiseParallel as TRW
    from torch.distributed.tensor.parallel import parallelize_module as t_par

    from shardtensor.examples.tiny_lm import build_model

    tmesh = t_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    tm = build_model(0).to(device)
    plan = {"attn.q": TC(), "attn.k": TC(), "attn.v": TC(), "attn.o": TRW(), "mlp.up": TC(), "mlp.down": TRW()}
    for blk in tm.blocks:
        t_par(blk, tmesh["tp"], plan)
    t_par(tm, tmesh["tp"], {"head": TC(output_layouts=TR())})
    for blk in tm.blocks:
        t_fully_shard(blk, mesh=tmesh["dp"])
    t_fully_shard(tm, mesh=tmesh["dp"])
    return _step_loop(tm, tmesh.get_local_rank("dp"), warmup, iters, device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    warmup, iters = (1, 3) if args.quick else (3, args.iters or 10)
    from distributed import MultiprocessError, run_multiprocess

    run_args = dict(timeout=600, args=(warmup, iters, args.device), env={"OMP_NUM_THREADS": "1"})
    (t_ours, l_ours), (t_np, l_np) = run_multiprocess(_rank_ours, 4, **run_args)[0]
    try:
        t_theirs, l_theirs = run_multiprocess(_rank_torch, 4, **run_args)[0]
        failed = None
    except MultiprocessError as e:
        t_theirs, l_theirs, failed = [float("nan")], [], str(e).splitlines()[0]
    mo, mt, mn = statistics.median(t_ours), statistics.median(t_theirs), statistics.median(t_np)
    print(f"demo model (TinyLM), mesh (2, 2) dp x tp, 4 gloo processes on {args.device}, {warmup} warm-up + "
          f"{iters} timed steps")
    print(f"{'':24} {'median step':>12}")
    print(f"{'shardtensor':24} {mo * 1e3:10.1f} ms")
    print(f"{'  without prefetch':24} {mn * 1e3:10.1f} ms")
    print(f"{'PyTorch FSDP2 + TP':24} {mt * 1e3:10.1f} ms" + (f"  (failed: {failed})" if failed else ""))
    print(f"{'ratio ours / PyTorch':24} {mo / mt:10.2f}")
    print(f"{'ratio prefetch / none':24} {mo / mn:10.2f}")
    print("losses (ours | PyTorch):", " ".join(f"{a:.4f}|{b:.4f}" for a, b in zip(l_ours, l_theirs)))
    if failed:
        return 1
    worst = max(abs(a - b) for a, b in [*zip(l_ours, l_theirs), *zip(l_np, l_theirs)])
    print(f"max |loss difference| {worst:.1e}")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
