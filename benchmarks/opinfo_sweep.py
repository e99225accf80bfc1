"""Differential sweep over torch's OpInfo database: every op with CPU float32 samples, on DTensors.

    python benchmarks/opinfo_sweep.py                      # every op, 2 samples, every layout
    python benchmarks/opinfo_sweep.py --samples 1 --layouts first-shard
    python benchmarks/opinfo_sweep.py --ops cdist,fft.fft  # a few ops, by OpInfo name
    python benchmarks/opinfo_sweep.py --torch              # PyTorch's DTensor side by side

Each case runs one OpInfo sample with one layout of its tensor inputs, in the simulated world
(every rank a thread), forward and, where the op supports autograd, backward, and compares with
the same sample on one device (``tests/opcheck.py``: values, dtypes, shapes, local shards and
gradients; float tolerance 1e-3).  Layouts (OpInfo sizes are mostly uneven on 4 ranks):

* ``replicated``: every input ``Replicate`` on mesh (4,);
* ``first-shard``: the first tensor ``Shard(0)``, the others ``Replicate`` on (4,);
* ``last-shard``: every tensor ``Shard(last dim)`` on (4,);
* ``partial``: the first floating tensor ``Partial(sum)``, the others ``Replicate`` on (4,);
* ``2d``: the first tensor ``(Shard(0), Shard(last dim))`` on mesh (2, 2).

Outcomes: ``pass``; ``wrong`` (a silent difference, the worst); ``unsupported``
(``NotImplementedError``); ``crash`` (any other exception); ``hang`` (a collective timed out).
A plain tensor where a DTensor is due counts as a crash (torch's C++ builds some results with a
factory, e.g. ``matrix_rank`` of an empty matrix).  The ``empty`` factories are left out (their
values are uninitialized memory), and so are random ops (the sample calls an aten op tagged ``nondeterministic_seeded``: OpInfo
reseeds before each call, and shardtensor's dropout masks are valid masks, not torch's stream,
see docs/random.md), and so are samples dense torch refuses and sparse samples.  Ops without a rule run
through the replicate fallback, so they count as passing when its result is right.

``--torch`` runs PyTorch's DTensor on the same cases (same local pieces and Partial terms, same
comparison), its ranks on threads with torch's threaded process group (``torch_world.py``).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time
import warnings
from collections import Counter, defaultdict
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import opcheck  # noqa: E402

from shardtensor import Partial, Replicate, Shard  # noqa: E402
from shardtensor.errors import CollectiveTimeoutError, StuckRanksError  # noqa: E402

LAYOUTS = ("replicated", "first-shard", "last-shard", "partial", "2d")
OUTCOMES = ("pass", "wrong", "unsupported", "crash", "hang")
TOL = {"rtol": 1e-3, "atol": 1e-3}
R = Replicate()


def float32_ops(names: set[str] | None = None) -> list[Any]:
    """OpInfos with CPU float32 samples (optionally only those named), without the ``empty``
    factories (their values are whatever memory held)."""
    from torch.testing._internal.common_methods_invocations import op_db

    out = [info for info in op_db if torch.float32 in info.supported_dtypes("cpu") and "empty" not in info.name]
    if names:
        out = [info for info in out if info.name in names or f"{info.name}.{info.variant_test_name}" in names]
    return out


def samples(info: Any, n: int) -> list[Any]:
    """Up to ``n`` samples of ``info`` (float32, CPU, requiring grad where the op supports it),
    preferring, among its first ten, those whose input has dims to shard."""
    grad = bool(info.supports_autograd)
    first: list[Any] = []
    for s in info.sample_inputs("cpu", torch.float32, requires_grad=grad):
        first.append(s)
        if len(first) == 10:
            break
    first.sort(key=lambda s: not (isinstance(s.input, torch.Tensor) and s.input.ndim > 0))  # stable
    return first[:n]


def case_of(info: Any, sample: Any) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    """``(fn, tensors)``: ``fn(*tensors)`` runs the sample's call with its tensors replaced."""
    leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    tensors = [leaves[i].detach().clone() for i in where]
    post = sample.output_process_fn_grad

    def fn(*ts: Any) -> Any:
        flat = list(leaves)
        for i, t in zip(where, ts):
            flat[i] = t
        inp, args, kwargs = tree_unflatten(flat, spec)
        return post(info.op(inp, *args, **kwargs))

    return fn, tensors


def layout(name: str, tensors: list[torch.Tensor]) -> tuple[tuple, tuple] | None:
    """``(mesh shape, combo)`` for opcheck, or None when the layout does not apply."""
    if not tensors:
        return None
    first = tensors[0]
    if name == "replicated":
        return (4,), tuple((R,) for _ in tensors)
    if name == "first-shard":
        if first.ndim == 0:
            return None
        return (4,), ((Shard(0),),) + tuple((R,) for _ in tensors[1:])
    if name == "last-shard":
        if all(t.ndim == 0 for t in tensors):
            return None
        return (4,), tuple((Shard(t.ndim - 1),) if t.ndim else (R,) for t in tensors)
    if name == "partial":
        k = next((i for i, t in enumerate(tensors) if t.is_floating_point()), None)
        if k is None:
            return None
        return (4,), tuple((Partial("sum"),) if i == k else (R,) for i in range(len(tensors)))
    if name == "2d":
        if first.ndim == 0:
            return None
        return (2, 2), ((Shard(0), Shard(first.ndim - 1)),) + tuple((R, R) for _ in tensors[1:])
    raise ValueError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")


def classify(fn: Callable[..., Any], tensors: list[torch.Tensor], mesh: tuple, combo: tuple,
             grad: bool, runner: Callable[..., Any] | None = None) -> tuple[str, str]:
    """One case on one side (``runner``: None for shardtensor, ``torch_world.runner`` for
    PyTorch's DTensor): ``(outcome, first line of the message)``."""
    try:
        opcheck.check(fn, tensors, mesh, combos=[combo], grad=grad, tol=TOL, grad_tol=TOL, runner=runner)
        return "pass", ""
    except AssertionError as e:
        if "not a DTensor" in str(e):  # the right value, as a plain tensor: torch's C++ built it
            return "crash", _line(e)
        return "wrong", _line(e)
    except NotImplementedError as e:
        return "unsupported", _line(e)
    except (CollectiveTimeoutError, StuckRanksError, TimeoutError) as e:
        return "hang", _line(e)
    except Exception as e:  # noqa: BLE001 - every other failure is a crash to count
        return "crash", f"{type(e).__name__}: {_line(e)}"


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else ""


def _comparable(fn: Callable[..., Any], tensors: list[torch.Tensor]) -> bool:
    """False for random ops (two dense runs of the sample differ), for samples dense torch refuses,
    and for sparse or other non-strided tensors (DTensors are strided)."""
    if any(t.layout != torch.strided for t in tensors):
        return False
    try:
        with _SeenOps() as seen:
            a = fn(*tensors)
        b = fn(*tensors)
    except Exception:  # noqa: BLE001 - dense torch refuses the sample: nothing to compare
        return False
    if any(torch.Tag.nondeterministic_seeded in op.tags for op in seen.ops):
        return False  # OpInfo reseeds before each call; shardtensor's dropout masks are not torch's stream
    fa, fb = tree_flatten(a)[0], tree_flatten(b)[0]
    if any(isinstance(x, torch.Tensor) and x.layout != torch.strided for x in fa):
        return False
    return all(not isinstance(x, torch.Tensor) or _same(x, y) for x, y in zip(fa, fb))


class _SeenOps(TorchDispatchMode):
    """Records the aten ops a dense run calls."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[Any] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal values, NaNs in the same places (floats compared widened: some dtypes have no ``equal``)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.is_floating_point() or x.is_complex():
        wide = torch.complex128 if x.is_complex() else torch.float64
        x, y = x.to(wide), y.to(wide)
        return torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
    return torch.equal(x, y)


def sweep(ops: list[Any], n_samples: int, layouts: tuple[str, ...], sides: dict[str, Callable[..., Any] | None],
          report: Callable[[str, str, str, str, str], None] | None = None) -> dict[str, dict[str, Counter]]:
    """Run every case on every side; ``{side: {op name: Counter of outcomes (and of
    "replicated-fail")}}`` (random ops and refused samples left out)."""
    per_side: dict[str, dict[str, Counter]] = {side: defaultdict(Counter) for side in sides}
    for info in ops:
        name = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
        try:
            cases = [case_of(info, s) for s in samples(info, n_samples)]
        except Exception as e:  # noqa: BLE001 - the OpInfo cannot build samples on this torch
            if report:
                report("-", name, "-", "skipped", f"samples: {_line(e)}")
            continue
        for fn, tensors in cases:
            if not _comparable(fn, tensors):
                continue
            grad = bool(info.supports_autograd) and any(t.requires_grad for t in tensors)
            tensors = [t.detach() for t in tensors]
            for lay in layouts:
                placed = layout(lay, tensors)
                if placed is None:
                    continue
                for side, runner in sides.items():
                    outcome, msg = classify(fn, tensors, placed[0], placed[1], grad, runner)
                    per_side[side][name][outcome] += 1
                    if lay == "replicated" and outcome != "pass":
                        per_side[side][name]["replicated-fail"] += 1
                    if report and outcome != "pass":
                        report(side, name, lay, outcome, msg)
    return per_side


def summary(per_op: dict[str, Counter]) -> dict[str, Any]:
    totals: Counter = Counter()
    for c in per_op.values():
        totals.update({k: c[k] for k in OUTCOMES})
    n = sum(totals.values())
    clean = sum(1 for c in per_op.values() if sum(c[k] for k in OUTCOMES) and c["pass"] == sum(c[k] for k in OUTCOMES))
    return {"cases": n, "pass": totals["pass"], "pass %": 100.0 * totals["pass"] / max(n, 1),
            **{k: totals[k] for k in OUTCOMES if k != "pass"}, "ops": len(per_op),
            "ops passing every case": clean,
            "ops failing with every input replicated": sum(1 for c in per_op.values() if c["replicated-fail"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2, help="samples per op (default 2)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    ap.add_argument("--ops", default="", help="comma-separated OpInfo names (default: every op)")
    ap.add_argument("--torch", action="store_true", help="also run PyTorch's DTensor on every case, side by side")
    ap.add_argument("--quiet", action="store_true", help="totals only, no line per failing case")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    opcheck.TIMEOUT = 30.0
    layouts = tuple(x for x in args.layouts.split(",") if x)
    ops = float32_ops(set(args.ops.split(",")) if args.ops else None)
    sides: dict[str, Callable[..., Any] | None] = {"shardtensor": None}
    if args.torch:
        import torch_world

        sides["torch DTensor"] = torch_world.runner
    t0 = time.time()

    def report(side: str, name: str, lay: str, outcome: str, msg: str) -> None:
        if not args.quiet:
            print(f"{side:13s} {outcome:11s} {name:32s} {lay:11s} {msg}", flush=True)

    per_side = sweep(ops, args.samples, layouts, sides, report)
    print(f"\ntorch {torch.__version__}; {len(ops)} OpInfos with CPU float32 samples; {args.samples} samples; "
          f"layouts {', '.join(layouts)}; {time.time() - t0:.0f} s\n")
    rows = {side: summary(per_op) for side, per_op in per_side.items()}
    print(f"{'':40s}" + "".join(f"{side:>16s}" for side in rows))
    for k in next(iter(rows.values())):
        print(f"{k:40s}" + "".join(f"{r[k]:16.2f}" if isinstance(r[k], float) else f"{r[k]:16d}"
                                   for r in rows.values()))
    if len(per_side) == 2:
        a, b = (set(n for n, c in p.items() if c["pass"] == sum(c[k] for k in OUTCOMES)) for p in per_side.values())
        print(f"{'ops passing every case on both sides':40s}{len(a & b):16d}")


if __name__ == "__main__":
    main()
