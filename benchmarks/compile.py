"""torch.compile on TP, FSDP and 2-D models: graphs, graph breaks, compile time and step time, ours vs PyTorch.

    python benchmarks/compile.py                    # the demo model, worlds 1 and 4, eager/aot_eager/inductor
    python benchmarks/compile.py --big              # a 12-layer d=768 model instead (slow on 2 CPU cores)
    python benchmarks/compile.py --quick --modes aot_eager --worlds 4
    python benchmarks/compile.py --quick --worlds 1 --optim compiled   # Adam's step compiled too
    python benchmarks/compile.py --interleaved --big   # world 1, every case in one process, steps in turns

A step is ``zero_grad``, the compiled forward, cross-entropy, backward and an Adam step: with
``--optim default`` torch's own choice (on CPU its single-tensor loop, eager), ``foreach`` (what
torch picks by default on a GPU, eager), or ``compiled`` (foreach, ``torch.compile(opt.step)``
with the case's backend; eager cases keep an eager step).
Every case runs in its own gloo processes (``OMP_NUM_THREADS=1``; a case that hangs or fails is a
row saying so), ours and PyTorch's DTensor over the same cases, model, initial values and batches:

- ``tp``: ``parallelize_module`` with the demo's plan (q/k/v/up column-wise, o/down row-wise, the
  head column-wise with a replicated output) on a 1-D mesh of every rank;
- ``fsdp``: ``fully_shard`` on every block, then the root, on a 1-D mesh of every rank;
- ``2d``: torch's 2-D recipe on a ``("dp", "tp")`` mesh (world 4: (2, 2); world 1: (1, 1));
- ``plain`` (world 1): the model on local tensors, the floor the wrapped rows are compared with.

Per case: ``graphs`` (dynamo's unique graphs), ``breaks`` (graph breaks dynamo counted),
``recompiles`` (graphs added after the first step: 0 when the guards hold), the first step's
time minus a steady step's (``compile s``), the median steady step (the slowest rank's), the
largest loss difference from the same library's eager run, ours / PyTorch, and whether a fresh
model runs one step under ``fullgraph=True`` (dynamo's counters miss frames it skips whole, such
as a module whose hooks it may not trace, so only this column proves "no graph breaks").

``--interleaved`` answers one question more precisely: what a compiled step costs at world 1
against the plain model's.  Separate processes differ by up to about 10% on this machine, more
than the difference sought, so there every case (the plain model, ours and PyTorch's over
``--parallel``; a case that fails to compile is left out) is built in ONE gloo process of world
1 and compiled with ``inductor`` (Adam's foreach step compiled too), and the timed steps run in
turns, one step per case per round, each round starting at the next case.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import statistics
import sys
import time
from typing import Any

import _gloo_setup  # noqa: F401  (src/ and tests/ on sys.path)
from _gloo_setup import run_multiprocess

PARALLEL = ("tp", "fsdp", "2d")
MODES = ("eager", "aot_eager", "inductor")
DEMO = dict(vocab=64, dim=32, heads=4, layers=2, seq=16, batch=8)
BIG = dict(vocab=1024, dim=768, heads=12, layers=12, seq=64, batch=4)


def _model(cfg: dict, seed: int = 0):
    """A decoder of ``cfg["layers"]`` demo blocks (``shardtensor.examples.tiny_lm.Block``), fixed values."""
    import torch
    import torch.nn as nn

    from shardtensor.examples.tiny_lm import Block

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(cfg["vocab"], cfg["dim"]), nn.Embedding(cfg["seq"], cfg["dim"])
            self.blocks = nn.ModuleList(Block(cfg["dim"], cfg["heads"]) for _ in range(cfg["layers"]))
            self.ln_f, self.head = nn.LayerNorm(cfg["dim"]), nn.Linear(cfg["dim"], cfg["vocab"])

        def forward(self, tokens):
            x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(seed)
    return LM()


def _apis(lib: str) -> dict[str, Any]:
    """The mesh, TP and FSDP entry points of one library (the same names in both)."""
    if lib == "ours":
        from shardtensor import init_device_mesh
        from shardtensor.fsdp import fully_shard
        from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from shardtensor.placement import Replicate
    else:
        from torch.distributed.device_mesh import init_device_mesh  # type: ignore[no-redef]
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
        from torch.distributed.tensor import Replicate  # type: ignore[no-redef]
        from torch.distributed.tensor.parallel import (  # type: ignore[no-redef]
            ColwiseParallel, RowwiseParallel, parallelize_module)
    return dict(mesh=init_device_mesh, fsdp=fully_shard, col=ColwiseParallel, row=RowwiseParallel,
                par=parallelize_module, rep=Replicate)


def _wrap(model, lib: str, parallel: str, world: int):
    """``model`` under ``parallel`` with ``lib``; returns it and this rank's dp index and dp size."""
    if parallel == "plain":
        return model, 0, 1
    a = _apis(lib)
    if parallel == "2d":
        mesh = a["mesh"]("cpu", (world // 2, 2) if world > 1 else (1, 1), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    else:
        tp_mesh = dp_mesh = a["mesh"]("cpu", (world,))
    if parallel in ("tp", "2d"):
        col, row = a["col"], a["row"]
        plan = {"attn.q": col(), "attn.k": col(), "attn.v": col(), "attn.o": row(), "mlp.up": col(),
                "mlp.down": row()}
        for blk in model.blocks:
            a["par"](blk, tp_mesh, plan)
        a["par"](model, tp_mesh, {"head": col(output_layouts=a["rep"]())})
    if parallel in ("fsdp", "2d"):
        for blk in model.blocks:
            a["fsdp"](blk, mesh=dp_mesh)
        a["fsdp"](model, mesh=dp_mesh)
        return model, dp_mesh.get_local_rank(), dp_mesh.size()
    return model, 0, 1


def _train_step(model: Any, opt: Any, opt_step: Any, x: Any, y: Any, vocab: int) -> Any:
    """``zero_grad``, forward, cross-entropy, backward and the optimizer step; returns the loss."""
    import torch.nn.functional as F

    opt.zero_grad()
    loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
    loss.backward()
    opt_step()
    return loss


def _reason(e: BaseException, limit: int = 120) -> str:
    """A failed case's row: the exception's type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:limit] if str(e) else ''}"


def _case(lib: str, parallel: str, mode: str, world: int, cfg: dict, warmup: int, iters: int, optim: str) -> dict:
    """One case on this rank: counters, the first step's time, the steady steps' times, the losses."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, dp, dps = _wrap(_model(cfg), lib, parallel, world)
    step_model = model if mode == "eager" else torch.compile(model, backend=mode)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **({} if optim == "default" else {"foreach": True}))
    opt_step = torch.compile(opt.step, backend=mode) if optim == "compiled" and mode != "eager" else opt.step
    g = torch.Generator().manual_seed(1)
    share = cfg["batch"] // dps
    times, losses, graphs_after_first = [], [], 0
    for s in range(1 + warmup + iters):
        x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
        x, y = x[dp * share:(dp + 1) * share], ((x + 1) % cfg["vocab"])[dp * share:(dp + 1) * share]
        dist.barrier()
        t0 = time.perf_counter()
        loss = _train_step(step_model, opt, opt_step, x, y, cfg["vocab"])
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item())
        losses.append(loss.item())
        if s == 0:
            graphs_after_first = counters["stats"]["unique_graphs"]
    graphs = counters["stats"]["unique_graphs"]
    steady = statistics.median(times[1 + warmup:])
    return dict(graphs=graphs, breaks=sum(counters["graph_break"].values()), recompiles=graphs - graphs_after_first,
                compile=times[0] - steady, step=steady, losses=losses)


def _fullgraph(rank: int, world: int, lib: str, parallel: str, cfg: dict) -> str:
    """Whether one forward and backward runs under ``fullgraph=True`` ("yes", else dynamo's reason:
    dynamo's counters miss the frames it skips whole, so this is the one sure test of no breaks).
    Graph breaks are dynamo's, whatever the backend, so ``aot_eager`` answers for every mode.  Its
    own processes: a refused step leaves FSDP mid-forward (PyTorch's FSDP2 then hung a later case)."""
    import torch
    import torch.distributed as dist

    _rank_setup()
    model, _, dps = _wrap(_model(cfg), lib, parallel, world)
    x = torch.zeros(cfg["batch"] // dps, cfg["seq"], dtype=torch.long)
    try:
        torch.compile(model, backend="aot_eager", fullgraph=True)(x).float().sum().backward()
        ok = torch.ones(1)
        reason = "yes"
    except Exception as e:  # noqa: BLE001 - reported in the table
        ok = torch.zeros(1)
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        reason = "no: " + (lines[0][:90] if lines else type(e).__name__)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank failed or none (a rank that went on would wait)
    return reason if ok.item() or reason != "yes" else "no: another rank failed"


def _rank_setup() -> None:
    """Each rank: one thread, quiet warnings, and a stack dump of every thread if it stalls."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(float(os.environ.get("COMPILE_BENCH_STALL_S", "400")), exit=True)


def _rank(rank: int, world: int, lib: str, case: tuple, cfg: dict, warmup: int, iters: int, optim: str) -> dict:
    """One case on this rank; a case that raises is reported, not fatal."""
    _rank_setup()
    try:
        return _case(lib, *case, world, cfg, warmup, iters, optim)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return dict(error=_reason(e))


def _launch(fn: Any, world: int, args: tuple) -> Any:
    """Rank 0's result of ``fn`` in fresh gloo processes, or, when a rank failed or hung, a line
    naming each rank's fate: such a case is a row that says so (PyTorch's FSDP2 on the 2-D mesh
    hung in backward in some runs), not the end of the run."""
    from distributed import MultiprocessError

    env = {"OMP_NUM_THREADS": "1", "SHARDTENSOR_COMM_TIMEOUT": "300"}
    try:
        return run_multiprocess(fn, world, timeout=900, args=args, env=env)[0]
    except MultiprocessError as e:
        return "ranks failed or hung: " + " | ".join(
            ln.strip() for ln in str(e).splitlines() if ln.strip().startswith("rank "))[:200]


def _run(lib: str, world: int, cases: list, cfg: dict, warmup: int, iters: int, optim: str) -> list:
    """Each case in its own processes."""
    out = [_launch(_rank, world, (lib, case, cfg, warmup, iters, optim)) for case in cases]
    return [dict(error=r) if isinstance(r, str) else r for r in out]


def _probe(lib: str, world: int, parallel: str, cfg: dict) -> str:
    return _launch(_fullgraph, world, (lib, parallel, cfg))


def _interleaved(rank: int, world: int, cases: list, cfg: dict, warmup: int, rounds: int) -> list[tuple]:
    """Each case's median step (ms), or its error, with the steps of all cases taken in turns."""
    import torch

    _rank_setup()
    torch._dynamo.config.cache_size_limit = 64  # one entry per case on the shared forward and step code
    g = torch.Generator().manual_seed(1)
    live: dict[tuple, Any] = {}
    out: dict[tuple, Any] = {}

    def step(model: Any, opt: Any, opt_step: Any) -> float:
        x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
        t0 = time.perf_counter()
        _train_step(model, opt, opt_step, x, (x + 1) % cfg["vocab"], cfg["vocab"])
        return time.perf_counter() - t0

    for lib, parallel in cases:
        try:
            model = _wrap(_model(cfg), lib, parallel, world)[0]
            opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
            live[lib, parallel] = (torch.compile(model, backend="inductor"), opt,
                                   torch.compile(opt.step, backend="inductor"))
            for _ in range(warmup + 1):
                step(*live[lib, parallel])
        except Exception as e:  # noqa: BLE001 - reported in the table
            live.pop((lib, parallel), None)
            out[lib, parallel] = _reason(e, 100)
    times: dict[tuple, list[float]] = {k: [] for k in live}
    keys = list(live)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[k].append(step(*live[k]))
    out.update({k: statistics.median(v) * 1e3 for k, v in times.items()})
    return [(lib, p, out[lib, p]) for lib, p in cases]


def _print_interleaved(args: Any, cfg: dict, pars: list[str]) -> int:
    import torch

    rounds = 4 if args.quick else (10 if args.big else 100)
    cases = [("ours", "plain")] + [(lib, p) for p in pars for lib in ("ours", "torch")]
    print(f"torch {torch.__version__}, model {cfg}, world 1 (one gloo process, OMP_NUM_THREADS=1), inductor, "
          f"foreach Adam step compiled; 2 warm-up steps per case, then {rounds} rounds of one step per case in turns")
    res = _launch(_interleaved, 1, (cases, cfg, 2, rounds))
    if isinstance(res, str):
        print(res)
        return 1
    plain = res[0][2]
    print(f"{'case':6} {'lib':6} {'step ms':>9} {'/plain':>7}")
    for lib, p, r in res:
        print(f"{p:6} {'-' if p == 'plain' else lib:6} " + (f"{r:9.1f} {r / plain:7.3f}" if isinstance(r, float) else f"failed: {r}"))
    return 0


def _fmt(r: dict, full: str) -> list[str]:
    if "error" in r:
        return ["failed", "", "", "", "", r["error"]]
    return [str(r["graphs"]), str(r["breaks"]), str(r["recompiles"]), f"{r['compile']:.1f}", f"{r['step'] * 1e3:.1f}",
            full]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", action="store_true", help="the 12-layer d=768 model instead of the demo's")
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 3 timed steps (default 2 + 10)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--worlds", default="1,4")
    ap.add_argument("--parallel", default=",".join(PARALLEL))
    ap.add_argument("--optim", default="default", choices=("default", "foreach", "compiled"),
                    help="Adam's step: torch's default choice, foreach, or foreach under torch.compile")
    ap.add_argument("--interleaved", action="store_true",
                    help="world 1 only: every case in one process, their compiled steps timed in turns")
    args = ap.parse_args()
    cfg = BIG if args.big else DEMO
    if args.interleaved:
        return _print_interleaved(args, cfg, [p for p in args.parallel.split(",") if p])
    warmup, iters = (1, 3) if args.quick else (2, 10)
    modes = [m for m in args.modes.split(",") if m]
    pars = [p for p in args.parallel.split(",") if p]
    import torch

    print(f"torch {torch.__version__}, model {cfg}, {warmup} warm-up + {iters} timed steps, gloo processes, "
          f"OMP_NUM_THREADS=1, Adam step: {args.optim}")
    head = ["world", "case", "mode", "lib", "graphs", "breaks", "recompiles", "compile s", "step ms", "|dloss| vs eager",
            "step ours/torch", "step/plain", "fullgraph=True"]
    rows: list[list[str]] = []
    for world in [int(w) for w in args.worlds.split(",")]:
        cases = [(p, m) for p in pars for m in modes]
        res = {lib: _run(lib, world, cases, cfg, warmup, iters, args.optim) for lib in ("ours", "torch")}
        compiled = any(m != "eager" for m in modes)
        full = {(lib, p): _probe(lib, world, p, cfg) if compiled else "-" for lib in ("ours", "torch") for p in pars}
        base: dict[str, float] = {}
        if world == 1:
            plain = _run("ours", 1, [("plain", m) for m in modes], cfg, warmup, iters, args.optim)
            plain_full = _probe("ours", 1, "plain", cfg) if compiled else "-"
            for m, r in zip(modes, plain):
                f = _fmt(r, "-" if m == "eager" else plain_full)
                rows.append([str(world), "plain", m, "-", *f[:5], "", "", "1", f[5]])
                if "error" not in r:
                    base[m] = r["step"]
        for i, (p, m) in enumerate(cases):
            for lib in ("ours", "torch"):
                r, eager = res[lib][i], res[lib][cases.index((p, "eager"))] if (p, "eager") in cases else None
                d = ""
                if eager and "error" not in eager and "error" not in r:
                    d = f"{max(abs(a - b) for a, b in zip(r['losses'], eager['losses'])):.1e}"
                ratio = ""
                o, t = res["ours"][i], res["torch"][i]
                if lib == "ours" and "error" not in o and "error" not in t:
                    ratio = f"{o['step'] / t['step']:.2f}"
                f = _fmt(r, "-" if m == "eager" else full[lib, p])
                vs = f"{r['step'] / base[m]:.2f}" if m in base and "error" not in r else ""
                rows.append([str(world), p, m, lib, *f[:5], d, ratio, vs, f[5]])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
