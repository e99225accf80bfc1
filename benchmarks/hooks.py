"""CPU time that FSDP and TP add per training step: shardtensor vs PyTorch FSDP2 / TP, same run.

    python benchmarks/hooks.py                  # worlds 1 and 4, 10 rounds
    python benchmarks/hooks.py --quick          # 3 rounds

Two models: the demo's ``TinyLM`` (2 blocks, 6 Linear layers each, FSDP on every block and the
root) and a stack of 24 small residual MLP layers (64 -> 128 -> 64, FSDP on every layer and the
root).  Each is timed plain (an ``nn.Module`` on local tensors) and wrapped by each library:

- ``fsdp``: ``fully_shard`` on the layers, then the root, on a 1-D mesh of every rank;
- ``tp``: ``parallelize_module`` (q/k/v/up column-wise, o/down row-wise) on a 1-D mesh;
- ``fsdp x tp``: torch's 2-D recipe, TP on ``mesh["tp"]`` then FSDP on ``mesh["dp"]``.

A step is ``zero_grad``, forward, a sum loss and backward (the optimizer is
``benchmarks/optimizer.py``'s).  Both libraries run on torch's ``fake`` process group (this
process is rank 0; collectives return at once and move nothing), so what a wrapping adds to the
plain step on the same local batch is CPU time alone: hooks, parameter handling, copies and
DTensor dispatch.  World 1 has every row (the math equals the plain model's).  World 4 has the
FSDP rows (still the same math: every rank computes with the whole parameters); TP's local math
shrinks there, so it has no plain twin.  Each world runs in its own child process; the variants
run interleaved, in rounds, with the GC off while timed; each figure is the median over every
timed step.  The target of the overhead issue: ours <= 0.5x PyTorch's overhead.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

STACK_LAYERS, STACK_DIM, STACK_BATCH = 24, 64, 16


def _stack(seed: int):
    """24 residual MLP layers on a (16, 64) input, deterministic weights."""
    import torch
    import torch.nn as nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(STACK_DIM, 2 * STACK_DIM), nn.Linear(2 * STACK_DIM, STACK_DIM)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(STACK_LAYERS))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(seed)
    return Stack()


def _models():
    """name -> (build, layers, TP plan of a layer, extra TP plan of the root, input)."""
    import torch

    from shardtensor.examples.tiny_lm import BATCH, build_model, batch

    lm_plan = {"attn.q": "col", "attn.k": "col", "attn.v": "col", "attn.o": "row", "mlp.up": "col", "mlp.down": "row"}
    g = torch.Generator().manual_seed(0)
    return {
        "demo TinyLM": (build_model, lambda m: list(m.blocks), lm_plan, {"head": "col_rep"}, batch(0, 0)[0][:BATCH // 2]),
        f"stack of {STACK_LAYERS}": (_stack, lambda m: list(m.layers), {"up": "col", "down": "row"}, {},
                                     torch.randn(STACK_BATCH, STACK_DIM, generator=g)),
    }


def _styles(lib: str, plan: dict[str, str]) -> dict[str, Any]:
    if lib == "ours":
        from shardtensor.parallel import ColwiseParallel, RowwiseParallel
        from shardtensor.placement import Replicate
    else:
        from torch.distributed.tensor import Replicate  # type: ignore[assignment]
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # type: ignore[assignment]
    make = {"col": ColwiseParallel, "row": RowwiseParallel, "col_rep": lambda: ColwiseParallel(output_layouts=Replicate())}
    return {k: make[v]() for k, v in plan.items()}


def _wrap(lib: str, how: str, model, layers, plan, root_plan, world: int):
    """``model`` wrapped by ``lib`` ("ours" or "torch") as ``how`` ("fsdp", "tp", "fsdp x tp")."""
    if lib == "ours":
        from shardtensor import init_device_mesh
        from shardtensor.fsdp import fully_shard
        from shardtensor.parallel import parallelize_module
    else:
        from torch.distributed.device_mesh import init_device_mesh  # type: ignore[assignment]
        from torch.distributed.fsdp import fully_shard  # type: ignore[assignment]
        from torch.distributed.tensor.parallel import parallelize_module  # type: ignore[assignment]
    if how == "fsdp x tp":
        tp = 2 if world % 2 == 0 else 1
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    else:
        dp_mesh = tp_mesh = init_device_mesh("cpu", (world,))
    if how in ("tp", "fsdp x tp"):
        for layer in layers:
            parallelize_module(layer, tp_mesh, _styles(lib, plan))
        if root_plan:
            parallelize_module(model, tp_mesh, _styles(lib, root_plan))
    if how in ("fsdp", "fsdp x tp"):
        for layer in layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def _step_fn(model, x) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = model(x)
        if hasattr(out, "to_local"):
            out = out.to_local()
        out.float().sum().backward()
    return step


def _child(world: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """This process as rank 0 of a ``fake`` world: per model and variant, the median step in seconds."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    hows = HOWS if world == 1 else ("fsdp",)  # TP's local math shrinks with more ranks: no plain twin
    out: dict[str, dict[str, float]] = {}
    for name, (build, layers_of, plan, root_plan, x) in _models().items():
        variants: dict[str, Callable[[], None]] = {"plain": _step_fn(build(0), x)}
        for how in hows:
            for lib in ("ours", "torch"):
                m = build(0)
                variants[f"{how} {lib}"] = _step_fn(_wrap(lib, how, m, layers_of(m), plan, root_plan, world), x)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(rounds + 1):  # round 0 warms up (plans, caches, first-forward recording)
            for k, fn in variants.items():
                gc.collect()
                gc.disable()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    fn()
                    if r:
                        times[k].append(time.perf_counter() - t0)
                gc.enable()
        out[name] = {k: statistics.median(v) for k, v in times.items()}
    dist.destroy_process_group()
    return out


HOWS = ("fsdp", "tp", "fsdp x tp")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 10)
    if args.child:
        print(json.dumps(_child(args.worlds[0], rounds, args.steps)))
        return 0
    import torch

    print(f"torch {torch.__version__}, cpu, 1 thread, fake process group, {rounds} rounds x {args.steps} steps "
          "(+1 warm-up round); ms per step (zero_grad, forward, backward); overhead = step - plain")
    ok = True
    for world in args.worlds:
        cmd = [sys.executable, __file__, "--child", "--worlds", str(world), "--rounds", str(rounds),
               "--steps", str(args.steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if run.returncode != 0:
            raise SystemExit(f"the world-{world} child failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
        res = json.loads(run.stdout.strip().splitlines()[-1])
        for name, t in res.items():
            plain = t["plain"]
            print(f"\nworld {world}, {name}: plain {plain * 1e3:.2f} ms")
            print(f"{'':12} {'ours':>8} {'PyTorch':>8} {'ours ovh':>9} {'PyTorch ovh':>12} {'ovh ratio':>10} "
                  f"{'step ratio':>11}")
            for how in HOWS:
                if f"{how} ours" not in t:
                    continue
                o, p = t[f"{how} ours"], t[f"{how} torch"]
                ratio = (o - plain) / (p - plain) if p > plain else float("nan")
                print(f"{how:12} {o * 1e3:8.2f} {p * 1e3:8.2f} {(o - plain) * 1e3:9.2f} {(p - plain) * 1e3:12.2f} "
                      f"{ratio:10.2f} {o / p:11.2f}")
                ok &= ratio <= 0.5
    print("\ntarget: overhead ratio <= 0.5 on every row:", "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
