"""FSDP copy-in bandwidth: shardtensor's ``chunk_cat`` vs ``torch._chunk_cat`` vs a plain memcpy.

    python benchmarks/chunk_cat.py [--quick] [--mb 240] [--tensors 50] [--chunks 8] [--iters N]
    python benchmarks/chunk_cat.py --device cuda [--quick]

``--device cuda`` runs the GPU cases instead (see ``cuda_main``): CUDA-event timings of the
one-launch Triton kernels against ``torch._chunk_cat(out=)``, ``torch.split_with_sizes_copy(out=)``,
a device memcpy and our per-tensor ``copy_`` path, plus the CPU wall time of one call.

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
import importlib
import os
import random
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

from shardtensor.kernels import chunk_cat, split_with_sizes_copy  # noqa: E402

_cc_module = importlib.import_module("shardtensor.kernels.chunk_cat")  # the module, not the function

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


# -- CUDA ------------------------------------------------------------------------------------

DEVICE = "cuda"

CUDA_CASES = (  # name, tensor count, MB per tensor, dim, chunks, input dtype, output dtype
    ("50 x 4.8 MB fp32, dim 0, 8 chunks", 50, 4.8, 0, 8, torch.float32, torch.float32),
    ("50 x 4.8 MB bf16 -> fp32 out", 50, 4.8, 0, 8, torch.bfloat16, torch.float32),
    ("50 x 2.4 MB bf16, dim 0, 8 chunks", 50, 2.4, 0, 8, torch.bfloat16, torch.bfloat16),
    ("300 x 16 KB fp32, 8 chunks", 300, 0.016, 0, 8, torch.float32, torch.float32),
    ("28 x 12 MB fp32, 64 chunks", 28, 12.0, 0, 64, torch.float32, torch.float32),
)


def _cuda_inputs(n: int, mb: float, dtype: torch.dtype, k: int, seed: int = 0) -> List[torch.Tensor]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        numel = max(1, int(mb * 1e6 / torch.finfo(dtype).bits * 8 * rng.uniform(0.8, 1.2)))
        cols = 256 if numel >= 256 * 4 * k else 1
        rows = max(1, numel // cols)
        if rows % k == 0:
            rows += 1
        out.append(torch.randn(rows, cols, device=DEVICE).to(dtype))
    return out


def cuda_time(fns: Dict[str, Callable[[], object]], iters: int) -> Dict[str, tuple]:
    """Per method: (GPU ms per call from CUDA events, CPU wall us per call), methods interleaved.

    A sleep kernel queued ahead of the start event keeps the GPU busy while the host issues the
    call, so the events time the GPU work alone; the host's time is the second number."""
    gpu: Dict[str, List[float]] = {name: [] for name in fns}
    cpu: Dict[str, List[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(iters):
        for name, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(2_000_000)  # about a millisecond: longer than any call's host work
            a.record()
            t0 = time.perf_counter()
            fn()
            cpu[name].append((time.perf_counter() - t0) * 1e6)
            b.record()
            torch.cuda.synchronize()
            gpu[name].append(a.elapsed_time(b))
    return {name: (sorted(gpu[name])[len(gpu[name]) // 2], sorted(cpu[name])[len(cpu[name]) // 2]) for name in fns}


def _cuda_chunk_cat_case(case: tuple, iters: int) -> list:
    name, n, mb, dim, k, dt, odt = case
    tensors = _cuda_inputs(n, mb, dt, k)
    ref = torch._chunk_cat(tensors, dim, k).to(odt)
    t_out, o_out, f_out = (torch.empty_like(ref) for _ in range(3))
    src, buf = torch.empty_like(ref), torch.empty_like(ref)
    fns = {
        "memcpy": lambda: buf.copy_(src),
        "torch out=": lambda: torch._chunk_cat(tensors, dim, k, out=t_out),
        "ours out=": lambda: chunk_cat(tensors, dim, k, out=o_out),
        "per-tensor copy_": lambda: _cc_module._chunk_cat_strided(tensors, dim, k, out=f_out),
    }
    res = cuda_time(fns, iters)
    assert torch.equal(o_out, ref) and torch.equal(f_out, ref) and torch.equal(t_out, ref)
    gbs = {m: ref.numel() * ref.element_size() / (res[m][0] * 1e-3) / 1e9 for m in fns}
    return [name, f"{gbs['memcpy']:.0f}", f"{gbs['torch out=']:.0f}", f"{gbs['ours out=']:.0f}",
            f"{gbs['per-tensor copy_']:.0f}", f"{gbs['ours out='] / gbs['torch out=']:.2f}",
            f"{gbs['ours out='] / gbs['memcpy']:.2f}", f"{res['torch out='][1]:.0f}", f"{res['ours out='][1]:.0f}"]


def _cuda_split_case(iters: int) -> list:
    g = torch.Generator().manual_seed(1)
    sizes = [int(s) for s in torch.randint(1_000, 200_000, (100,), generator=g)]
    x = torch.randn(2, sum(sizes), device=DEVICE)
    outs_t = [torch.empty(2, s, device=DEVICE) for s in sizes]
    outs_o = [torch.empty(2, s, device=DEVICE) for s in sizes]
    outs_f = [torch.empty(2, s, device=DEVICE) for s in sizes]
    src, buf = torch.empty_like(x), torch.empty_like(x)
    fns = {
        "memcpy": lambda: buf.copy_(src),
        "torch out=": lambda: torch.split_with_sizes_copy(x, sizes, 1, out=outs_t),
        "ours out=": lambda: split_with_sizes_copy(x, sizes, 1, out=outs_o),
        "per-tensor copy_": lambda: _cc_module._split_strided(x, 1, sizes, outs_f),
    }
    res = cuda_time(fns, iters)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(outs_t, outs_o, outs_f))
    gbs = {m: x.numel() * 4 / (res[m][0] * 1e-3) / 1e9 for m in fns}
    return ["split_with_sizes_copy, 100 pieces, dim 1", f"{gbs['memcpy']:.0f}", f"{gbs['torch out=']:.0f}",
            f"{gbs['ours out=']:.0f}", f"{gbs['per-tensor copy_']:.0f}", f"{gbs['ours out='] / gbs['torch out=']:.2f}",
            f"{gbs['ours out='] / gbs['memcpy']:.2f}", f"{res['torch out='][1]:.0f}", f"{res['ours out='][1]:.0f}"]


def cuda_main(args: argparse.Namespace) -> None:
    """The GPU table: GB/s of output written (CUDA events, median of interleaved calls)."""
    iters = 5 if args.quick else 20
    rows = [_cuda_chunk_cat_case(c, iters) for c in CUDA_CASES] + [_cuda_split_case(iters)]
    head = ["case", "memcpy", "torch out=", "ours out=", "per-tensor copy_", "ours/torch", "ours/memcpy",
            "torch CPU us", "ours CPU us"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print(f"\nGB/s of output written (GPU time from CUDA events, the host's issue time hidden behind a sleep "
          f"kernel); {torch.cuda.get_device_name()}, torch {torch.__version__}, median of {iters} interleaved calls; "
          "CPU us = host wall time of one call.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="small size (8 MB, 10 tensors), few iterations")
    p.add_argument("--mb", type=float, default=240.0)
    p.add_argument("--tensors", type=int, default=50)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    if args.device == "cuda":
        cuda_main(args)
        return
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
