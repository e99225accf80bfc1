"""Optimizer steps over sharded parameters: shardtensor vs PyTorch's DTensor vs the local step.

    python benchmarks/optimizer.py            # 100 and 1,000 parameters
    python benchmarks/optimizer.py --quick    # fewer steps (smoke run)

Both libraries run on torch's ``fake`` process-group backend (world 4, this process is rank 0;
collectives return at once), one intra-op thread.  Half the parameters are 256x64 and half are
64-long vectors, all ``Shard(0)`` on a 1-D mesh of 4, with gradients of the same placements.
For AdamW, Adam and SGD (momentum 0.9) with each implementation torch offers -- ``foreach``
(one op per state list), ``fused`` (one kernel for the step) and ``single`` (a loop of ops per
parameter) -- it times ``optimizer.step()`` on:

* ``local``: plain tensors shaped like rank 0's shards (what the step costs without sharding);
* ``floor``: those local tensors in a minimal ``__torch_dispatch__`` wrapper subclass
  (``_floor.Floor``: unwrap, call, wrap, nothing else) -- what any tensor subclass pays, so
  ``floor/local`` bounds what a sharded tensor can reach with torch's optimizers;
* ``ours``: shardtensor DTensor parameters;
* ``dt``: PyTorch DTensor parameters;

and ``torch.nn.utils.clip_grad_norm_`` over the same gradients (foreach).  ``-TF/dt``: ours
with torch's C++ stand-in for our Python ``__torch_function__`` (``_floor.torch_function_off``)
over PyTorch's: what the step would cost without that handler, which an optimizer calls once per
foreach op and once per parameter in ``torch.is_complex``.  Times are medians
of the per-step host time; ratios are ``ours/local`` (targets: foreach and fused <= 1.3, single
<= 2), ``dt/local`` and ``ours/dt``.  The updated parameters of both libraries are compared
with the local step's after the timed steps (a mismatch is printed and fails the run).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from _floor import Floor, torch_function_off

SHAPES = ((256, 64), (64,))
WORLD = 4


def _params(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (full value, full gradient) pairs, half matrices and half vectors."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        shape = SHAPES[i % 2]
        out.append((torch.randn(*shape, generator=g), torch.randn(*shape, generator=g) * 1e-2))
    return out


def _make(lib: str, full: list[tuple[torch.Tensor, torch.Tensor]], mesh) -> list[torch.nn.Parameter]:
    """Parameters with gradients: rank 0's shards (``local``) or DTensors of either library."""
    params = []
    for value, grad in full:
        if lib == "local":
            p = torch.nn.Parameter(value.chunk(WORLD)[0].clone())
            p.grad = grad.chunk(WORLD)[0].clone()
        elif lib == "floor":
            p = torch.nn.Parameter(Floor(value.chunk(WORLD)[0].clone()))
            p.grad = Floor(grad.chunk(WORLD)[0].clone())
        else:
            mod = _lib(lib)
            p = torch.nn.Parameter(mod.distribute_tensor(value, mesh, [mod.Shard(0)]))
            p.grad = mod.distribute_tensor(grad, mesh, [mod.Shard(0)])
        params.append(p)
    return params


def _lib(lib: str):
    if lib == "ours":
        import shardtensor
        return shardtensor
    import torch.distributed.tensor as tdt
    return tdt


def _optimizer(name: str, impl: str, params: list) -> torch.optim.Optimizer:
    kw: dict = {"foreach": impl == "foreach", "fused": impl == "fused"} if impl != "single" else {"foreach": False}
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=1e-3, **kw)
    if name == "Adam":
        return torch.optim.Adam(params, lr=1e-3, **kw)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, **kw)


def _median_times(fns: dict[str, Callable[[], object]], steps: int, warmup: int) -> dict[str, float]:
    """Median host time of one call of each of ``fns``, the calls taken in turns (one step of each,
    ``steps`` rounds), so a machine that slows down slows all of them alike.  A variant that
    raises is reported once and timed as NaN."""
    live = dict(fns)
    for lib, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
        except Exception as e:  # noqa: BLE001  (reported, not hidden)
            print(f"   {lib} failed: {type(e).__name__}: {str(e)[:120]}")
            del live[lib]
    samples: dict[str, list[float]] = {lib: [] for lib in live}
    for _ in range(steps):
        for lib, fn in live.items():
            t0 = time.perf_counter()
            fn()
            samples[lib].append(time.perf_counter() - t0)
    return {lib: statistics.median(samples[lib]) if lib in samples else float("nan") for lib in fns}


def _without_torch_function(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with torch_function_off():
            return fn()
    return run


def _local_of(p) -> torch.Tensor:
    t = p.data
    if isinstance(t, Floor):
        return t._inner
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--counts", type=int, nargs="*", default=[100, 1000])
    args = ap.parse_args()
    steps, warmup = (5, 2) if args.quick else (20, 3)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    import shardtensor as st
    from torch.distributed.device_mesh import init_device_mesh as t_init

    ours_mesh = st.init_device_mesh("cpu", (WORLD,))
    meshes = {"ours": ours_mesh, "-TF": ours_mesh, "dt": t_init("cpu", (WORLD,)), "local": None, "floor": None}
    print(f"torch {torch.__version__}, cpu, fake process group (world {WORLD}, rank 0), 1 thread; params half "
          f"256x64, half 64, Shard(0); {steps} timed steps after {warmup}, the variants in turns, median ms per step")
    head = (f"{'params':>6} {'optimizer':9} {'impl':8} {'local':>9} {'floor':>9} {'ours':>9} {'dt':>9} "
            f"{'floor/local':>11} {'ours/local':>10} {'dt/local':>9} {'ours/dt':>8} {'ours/floor':>10} {'-TF/dt':>7}")
    print(head)
    print("-" * len(head))
    bad = 0
    for n in args.counts:
        full = _params(n)
        rows = [(o, i) for o in ("AdamW", "Adam", "SGD") for i in ("foreach", "fused", "single")]
        for name, impl in rows + [("clip_grad", "foreach")]:
            fns, made = {}, {}
            for lib in ("local", "floor", "ours", "dt", "-TF"):
                params = made[lib] = _make("ours" if lib == "-TF" else lib, full, meshes[lib])
                if name == "clip_grad":
                    def fn(params=params):
                        return torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                else:
                    fn = _optimizer(name, impl, params).step
                fns[lib] = fn if lib != "-TF" else _without_torch_function(fn)
            times = _median_times(fns, steps, warmup)
            bad += times["ours"] != times["ours"]  # NaN: ours failed
            finals = {lib: [_local_of(p) for p in made[lib]] for lib in made if times[lib] == times[lib]}
            for lib in ("floor", "ours", "dt", "-TF"):
                if lib in finals and not all(torch.allclose(a, b, rtol=1e-4, atol=1e-5)
                                             for a, b in zip(finals[lib], finals["local"])):
                    print(f"   mismatch: {lib} differs from the local step ({name}, {impl}, {n} params)")
                    bad += lib == "ours"
            t_l, t_f, t_o, t_d = times["local"], times["floor"], times["ours"], times["dt"]
            print(f"{n:>6} {name:9} {impl:8} {t_l * 1e3:8.2f}m {t_f * 1e3:8.2f}m {t_o * 1e3:8.2f}m {t_d * 1e3:8.2f}m "
                  f"{t_f / t_l:11.2f} {t_o / t_l:10.2f} {t_d / t_l:9.2f} {t_o / t_d:8.2f} {t_o / t_f:10.2f} "
                  f"{times['-TF'] / t_d:7.2f}")
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
