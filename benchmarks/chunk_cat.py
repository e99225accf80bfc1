"""FSDP copy-in bandwidth: shardtensor's ``chunk_cat`` vs ``torch._chunk_cat`` vs a plain memcpy.

    python benchmarks/chunk_cat.py [--quick] [--mb 240] [--tensors 50] [--chunks 8] [--iters N]

Inputs: ``--tensors`` float32 tensors of about ``--mb`` MB in total, sizes along the chunked dim
chosen (fixed seed) so that most of them need padding.  ``dim 0``: 2-D tensors ``(s_i, 512)``;
``dim 1``: 2-D tensors ``(16, s_i)`` (16 leading rows, so every output row holds 16 runs per
tensor).  Each case runs with 1 and 2 intra-op threads.

Columns (GB/s = bytes of the output written per second, best of ``--iters`` iterations, all
methods interleaved round-robin within one process run; best-of because the shared machine's
interference only ever slows a run down):
  memcpy      ``buf.copy_(src)`` of contiguous buffers with the output's byte count (the bar)
  torch       ``torch._chunk_cat(tensors, dim, k)`` (allocates the output)
  torch out=  ``torch._chunk_cat(..., out=buf)`` into a preallocated buffer
  ours        ``shardtensor.kernels.chunk_cat(tensors, dim, k)`` (allocates)
  ours out=   ``chunk_cat(..., out=buf)`` into a preallocated buffer
Ratios: ``ours out= / memcpy`` (target >= 0.90) and ``ours out= / torch out=``, ``ours / torch``.
The machine is a shared CPU box: only ratios within one run mean anything.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

from shardtensor.kernels import chunk_cat  # noqa: E402

METHODS = ("memcpy", "torch", "torch out=", "ours", "ours out=")


def make_inputs(total_mb: float, n: int, dim: int, k: int, seed: int = 0) -> List[torch.Tensor]:
    """``n`` float32 tensors of about ``total_mb`` MB; sizes along ``dim`` mostly not multiples of ``k``."""
    rng = random.Random(seed)
    other = 512 if dim == 0 else 16
    weights = [rng.uniform(0.5, 1.5) for _ in range(n)]
    scale = total_mb * 1e6 / 4 / other / sum(weights)   # rows along ``dim`` per unit weight
    tensors = []
    for w in weights:
        s = max(1, int(w * scale))
        if rng.random() < 0.8 and s % k == 0:
            s += 1                               # force padding on most tensors
        shape = (s, other) if dim == 0 else (other, s)
        tensors.append(torch.randn(shape))
    return tensors


def bench(fns: Dict[str, Callable[[], object]], iters: int) -> Dict[str, float]:
    """Best (minimum) seconds per call of each function, calls interleaved round-robin."""
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for fn in fns.values():                      # warm-up (page faults, caches)
        fn()
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(ts) for name, ts in times.items()}


def run_case(dim: int, threads: int, args: argparse.Namespace) -> Dict[str, object]:
    torch.set_num_threads(threads)
    k = args.chunks
    tensors = make_inputs(args.mb, args.tensors, dim, k)
    ref = torch._chunk_cat(tensors, dim, k)
    ours_out = torch.empty_like(ref)
    torch_out = torch.empty_like(ref)
    src = torch.randn(ref.numel())
    buf = torch.empty(ref.numel())
    assert torch.equal(chunk_cat(tensors, dim, k), ref)
    flat_out = ours_out.view(k, -1) if dim == 0 else ours_out   # FSDP passes a (k, -1) view
    ptr = ours_out.data_ptr()
    fns = {
        "memcpy": lambda: buf.copy_(src),
        "torch": lambda: torch._chunk_cat(tensors, dim, k),
        "torch out=": lambda: torch._chunk_cat(tensors, dim, k, out=torch_out),
        "ours": lambda: chunk_cat(tensors, dim, k),
        "ours out=": lambda: chunk_cat(tensors, dim, k, out=flat_out),
    }
    best = bench(fns, args.iters)
    assert ours_out.data_ptr() == ptr and torch.equal(ours_out, ref) and torch.equal(torch_out, ref)
    nbytes = ref.numel() * ref.element_size()
    in_bytes = sum(t.numel() * t.element_size() for t in tensors)
    gbs = {name: nbytes / best[name] / 1e9 for name in METHODS}
    return {"dim": dim, "threads": threads, "in_mb": in_bytes / 1e6, "out_mb": nbytes / 1e6, "gbs": gbs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small size (8 MB, 10 tensors), few iterations")
    p.add_argument("--mb", type=float, default=240.0)
    p.add_argument("--tensors", type=int, default=50)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    if args.quick:
        args.mb, args.tensors, args.iters = 8.0, 10, 5
    rows = [run_case(dim, threads, args) for dim in (0, 1) for threads in (1, 2)]

    head = ["dim", "thr", "in MB", "out MB"] + [f"{m} GB/s" for m in METHODS] + \
        ["ours out=/memcpy", "ours out=/torch out=", "ours/torch"]
    table = []
    for r in rows:
        g = r["gbs"]
        table.append([str(r["dim"]), str(r["threads"]), f"{r['in_mb']:.1f}", f"{r['out_mb']:.1f}"]
                     + [f"{g[m]:.2f}" for m in METHODS]
                     + [f"{g['ours out='] / g['memcpy']:.2f}", f"{g['ours out='] / g['torch out=']:.2f}",
                        f"{g['ours'] / g['torch']:.2f}"])
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("  ".join("-" * w for w in widths))
    for row in table:
        print("  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print(f"\n{args.tensors} float32 tensors, {args.chunks} chunks, best of {args.iters} interleaved iterations; "
          f"GB/s = output bytes / time; torch {torch.__version__}.")


if __name__ == "__main__":
    main()
