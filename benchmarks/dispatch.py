"""Eager dispatch overhead per op: shardtensor vs PyTorch's DTensor, same process, same data.

    python benchmarks/dispatch.py            # every op, meshes (4,) and (2, 2)
    python benchmarks/dispatch.py --quick    # fewer iterations (smoke run)
    python benchmarks/dispatch.py --device cuda   # the same on CUDA tensors (host wall time per op)

Both libraries run on torch's ``fake`` process-group backend (world 4, this process is rank 0;
collectives return at once without moving data), one intra-op thread, 64x64 fp32 inputs.
Per op and mesh it reports the median time per call (hits: the four variants timed in turns, 7
rounds, so that a machine slowing down slows them alike) of:

* ``local``: the plain torch op on the local shards rank 0 holds (what the local kernel costs);
* ``floor``: the op on a minimal ``__torch_dispatch__`` wrapper subclass around those local
  shards (``_floor.Floor``: unwrap the arguments, call the op, wrap each tensor result with
  ``_make_wrapper_subclass``, nothing else; torch-function handling disabled) -- the least any
  tensor subclass pays per op;
* ``ours hit`` / ``dt hit``: the op on sharded tensors with the sharding decision cached;
* ``ours miss`` / ``dt miss``: the same with the decision cache cleared before every call
  (ours: ``shardtensor.propagation.clear_cache()``; PyTorch: its C++ dispatch fast-path cache
  ``torch._C._clear_DTensor_sharding_propagator_cache()`` and the sharding propagator's Python LRU,
  reached through its attributes -- a benchmark-only use of private paths);

and the ratios ``hit/floor`` (target <= 1.1), ``hit/dt`` (target <= 1/3), ``hit/local`` (target
<= 2) and ``miss/dt`` (target <= 1/10).  ``TF``: what our Python ``__torch_function__`` adds to a
hit (ours hit minus our hit timed with torch's C++ stand-in in its place, which PyTorch's DTensor
and the floor use); ``-TF/dt``: that hit over PyTorch's.  Any mismatch between the two libraries' results or placements is printed.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import warnings
import torch.nn.functional as F

from _floor import Floor, torch_function_off


def _timeit(fn: Callable[[], object], iters: int, repeats: int = 5, before: Callable[[], None] | None = None,
            after: Callable[[], None] = lambda: None) -> float:
    """Median over ``repeats`` of the host time per call; ``after`` (a CUDA sync) runs between repeats."""
    for _ in range(max(3, iters // 10)):
        if before:
            before()
        fn()
    samples = []
    for _ in range(repeats):
        after()
        if before:
            t_total = 0.0
            for _ in range(iters):
                before()
                t0 = time.perf_counter()
                fn()
                t_total += time.perf_counter() - t0
            samples.append(t_total / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def _interleaved(fns: list[Callable[[], object]], iters: int, repeats: int = 7,
                 after: Callable[[], None] = lambda: None,
                 around: list[Callable[[], Any]] | None = None) -> list[float]:
    """Median host time per call of each of ``fns``, timed in turns (``iters`` calls of one, then
    the next, ``repeats`` rounds), so a machine that slows down slows all of them alike;
    ``around[i]()`` is a context manager entered around each block of ``fns[i]``'s calls."""
    ctxs = around or [contextlib.nullcontext] * len(fns)
    for fn, ctx in zip(fns, ctxs):
        with ctx():
            for _ in range(max(3, iters // 10)):
                fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ctx, out in zip(fns, ctxs, samples):
            after()
            with ctx():
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                after()
                out.append((time.perf_counter() - t0) / iters)
    return [statistics.median(x) for x in samples]


def _cases(two_d: bool, device: str = "cpu"):
    """(name, fn, [(tensor, placements spec string)...]) — placements as ('S0','R'...) per mesh dim."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=g).to(device)
    b = torch.randn(64, 64, generator=g).to(device)
    w = torch.randn(64, generator=g).to(device)
    bias = torch.randn(64, generator=g).to(device)
    if not two_d:
        S0, S1, R = ("S0",), ("S1",), ("R",)
        rows = S0
        mm = [(a, S1), (b, S0)]
        view_pl = S0
    else:
        S0, S1, R = ("S0", "S1"), ("S1", "S0"), ("R", "R")
        rows = ("S0", "R")  # softmax / layer_norm over the last dim: keep it whole
        mm = [(a, ("S0", "S1")), (b, ("R", "S0"))]
        view_pl = ("S0", "S1")
    return [
        ("add S0+S0", lambda x, y: x + y, [(a, S0), (b, S0)]),
        ("mul scalar", lambda x: x * 2.0, [(a, S0)]),
        ("mul tensor", lambda x, y: x * y, [(a, S0), (b, S0)]),
        ("sum(0)->P", lambda x: x.sum(0), [(a, S0)]),
        ("matmul ->P", lambda x, y: x @ y, mm),
        ("softmax(-1)", lambda x: torch.softmax(x, -1), [(a, rows)]),
        ("layer_norm", lambda x, w_, b_: F.layer_norm(x, (64,), w_, b_), [(a, rows), (w, R), (bias, R)]),
        ("view", lambda x: x.view(-1, 8, 8), [(a, view_pl)]),
        ("reshape", lambda x: x.reshape(-1, 8, 64), [(a, view_pl)]),
    ]


def _placements(lib, spec):
    out = []
    for s in spec:
        if s == "R":
            out.append(lib.Replicate())
        else:
            out.append(lib.Shard(int(s[1:])))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the tensors live; on cuda the times are host wall time per call")
    args = ap.parse_args()
    iters = args.iters or (50 if args.quick else 400)
    miss_iters = max(10, iters // 8)

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)

    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as t_init

    import shardtensor as st
    from shardtensor.propagation import clear_cache

    def dt_clear():
        # both of DTensor's caches: the C++ dispatch fast path's and the Python LRU behind it
        clear_cpp = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
        if clear_cpp is not None:
            clear_cpp()
        try:
            fn = tdt.DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
            if hasattr(fn, "cache_clear"):
                fn.cache_clear()
        except AttributeError:
            pass

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"torch {torch.__version__}, {args.device}, fake process group (world 4, rank 0), 1 thread, 64x64 fp32; "
          f"{iters} iterations (hit), {miss_iters} (miss), hits: median of 7 rounds in turns, misses: median of 5 repeats")
    header = (f"{'mesh':7} {'op':13} {'local':>8} {'floor':>8} {'ours hit':>9} {'dt hit':>8} {'ours miss':>10} "
              f"{'dt miss':>9} {'hit/floor':>9} {'hit/dt':>7} {'hit/local':>9} {'miss/dt':>8} {'TF':>6} "
              f"{'-TF/dt':>6}")
    print(header)
    print("-" * len(header))
    bad = 0
    ratios = []
    for mesh_shape in [(4,), (2, 2)]:
        ours_mesh = st.init_device_mesh(args.device, mesh_shape)
        dt_mesh = t_init(args.device, mesh_shape)
        for name, fn, inputs in _cases(len(mesh_shape) == 2, args.device):
            ours_in = [st.distribute_tensor(t, ours_mesh, _placements(st, pl)) for t, pl in inputs]
            dt_in = [tdt.distribute_tensor(t, dt_mesh, _placements(tdt, pl)) for t, pl in inputs]
            local_in = [x.to_local() for x in ours_in]
            floor_in = [Floor(x) for x in local_in]
            try:
                r_ours = fn(*ours_in)
            except Exception as e:  # noqa: BLE001
                print(f"{str(mesh_shape):7} {name:13} ours failed: {type(e).__name__}: {str(e)[:150]}")
                bad += 1
                continue
            r_dt = fn(*dt_in)
            if [str(p) for p in r_ours.placements] != [str(p) for p in _norm(r_dt.placements)]:
                print(f"   note: placements differ: ours {r_ours.placements}, DTensor {tuple(r_dt.placements)}")
            null = contextlib.nullcontext
            t_local, t_floor, t_ours, t_dt, t_notf = _interleaved(
                [lambda: fn(*local_in), lambda: fn(*floor_in), lambda: fn(*ours_in), lambda: fn(*dt_in),
                 lambda: fn(*ours_in)], iters, after=sync, around=[null, null, null, null, torch_function_off])
            t_ours_miss = _timeit(lambda: fn(*ours_in), miss_iters, before=clear_cache, after=sync)
            t_dt_miss = _timeit(lambda: fn(*dt_in), miss_iters, before=dt_clear, after=sync)
            r = (t_ours / t_floor, t_ours / t_dt, t_ours / t_local, t_ours_miss / t_dt_miss, t_notf / t_dt)
            ratios.append(r)
            print(f"{str(mesh_shape):7} {name:13} {t_local*1e6:7.1f}u {t_floor*1e6:7.1f}u {t_ours*1e6:8.1f}u "
                  f"{t_dt*1e6:7.1f}u {t_ours_miss*1e6:9.1f}u {t_dt_miss*1e6:8.1f}u {r[0]:9.2f} {r[1]:7.2f} "
                  f"{r[2]:9.2f} {r[3]:8.2f} {(t_ours - t_notf)*1e6:5.1f}u {r[4]:6.2f}")
    if ratios:
        gm = [statistics.geometric_mean([r[i] for r in ratios]) for i in range(5)]
        print(f"{'geomean':21} {'':>8} {'':>8} {'':>9} {'':>8} {'':>10} {'':>9} {gm[0]:9.2f} {gm[1]:7.2f} "
              f"{gm[2]:9.2f} {gm[3]:8.2f} {'':>6} {gm[4]:6.2f}")
    dist.destroy_process_group()
    return 1 if bad else 0


def _norm(pls):
    out = []
    for p in pls:
        s = type(p).__name__
        if s == "Shard":
            out.append(f"S({p.dim})")
        elif s == "Replicate":
            out.append("R")
        else:
            out.append(f"P({getattr(p, 'reduce_op', 'sum')})")
    return out


if __name__ == "__main__":
    sys.exit(main())
