"""Differential sweep over torch's OpInfo database: every op with CPU float32 samples, on DTensors.

    python benchmarks/opinfo_sweep.py                      # every op, 4 samples, every layout
    python benchmarks/opinfo_sweep.py --samples 0          # every sample of every op
    python benchmarks/opinfo_sweep.py --samples 1 --layouts shard
    python benchmarks/opinfo_sweep.py --ops cdist,fft.fft  # a few ops, by OpInfo name
    python benchmarks/opinfo_sweep.py --torch              # PyTorch's DTensor side by side

Each case runs one OpInfo sample with one layout of its tensor inputs, in the simulated world
(every rank a thread), forward and, where the op supports autograd, backward with a random
upstream gradient, comparing with the same sample on one device (``tests/opcheck.py``: values,
dtypes, shapes, local shards, every input's gradient; float tolerance 1e-3).

Samples: up to ``--samples`` per op, picked from the first 60 to cover the most kinds of input
(square, non-square and batched matrices, vectors, scalars, empty tensors, dims that 4 ranks split
evenly and unevenly).  Layout families (every other input ``Replicate``):

* ``replicated``: every input ``Replicate`` on mesh (4,);
* ``shard``: each input in turn (every floating one, and the first) ``Shard(d)`` for each of its
  dims ``d``, on (4,);
* ``partial``: each floating input in turn ``Partial(sum)`` on (4,), its values rounded to
  multiples of 2**-10 so the random terms sum to it exactly (a discontinuous op must see the
  same input as one device);
* ``2d``: each such input ``(Shard(0), Shard(last))`` and ``(Shard(last), Partial(sum))`` on (2, 2);
* ``strided``: each such input packed, ``StridedShard(d, 2)`` for each of its dims on (4,), and
  ``(Shard(0), StridedShard(last, 2))`` on (2, 2).

Random ops (an aten op tagged ``nondeterministic_seeded`` runs; OpInfo's reseeding wrapper is
undone) are checked by property against 16 dense runs (``Random``): shapes, dtypes, replicas
equal on every rank, NaN/inf only where dense gives them, masks taking dense's two values, and
median and spread of the values.  Samples whose dense runs differ beyond rounding, samples dense
torch refuses and sparse samples are left out.

Outcomes: ``pass``; ``wrong`` (a silent difference, the worst); ``unsupported``
(``NotImplementedError``); ``crash`` (any other exception); ``hang`` (a collective timed out).
A plain tensor where a DTensor is due counts as a crash.  The ``empty`` factories are left out
(their values are whatever memory held).  Ops without a rule run through the replicate fallback,
so they count as passing when its result is right.

``--torch`` runs PyTorch's DTensor on the same cases (same local pieces and Partial terms, same
comparison), its ranks on threads with torch's threaded process group (``torch_world.py``).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import opcheck  # noqa: E402

from shardtensor import Partial, Replicate, Shard, StridedShard  # noqa: E402
from shardtensor.errors import CollectiveTimeoutError, StuckRanksError  # noqa: E402

LAYOUTS = ("replicated", "shard", "partial", "2d", "strided")
OUTCOMES = ("pass", "wrong", "unsupported", "crash", "hang")
TOL = {"rtol": 1e-3, "atol": 1e-3}
R = Replicate()


def float32_ops(names: set[str] | None = None) -> list[Any]:
    """OpInfos with CPU float32 samples (optionally only those named), without the ``empty``
    factories (their values are whatever memory held)."""
    from torch.testing._internal.common_methods_invocations import op_db

    _unseeded()
    out = [info for info in op_db if torch.float32 in info.supported_dtypes("cpu") and "empty" not in info.name]
    if names:
        out = [info for info in out if info.name in names or f"{info.name}.{info.variant_test_name}" in names]
    return out


def _unseeded() -> None:
    """OpInfo wraps random ops in ``wrapper_set_seed`` (reseed to 42 before each call): undone, so
    that repeated dense runs show the op's distribution, which random ops are checked against."""
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "")
        if name.startswith("torch.testing._internal") and hasattr(mod, "wrapper_set_seed"):
            mod.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)


def samples(info: Any, n: int) -> list[Any]:
    """Up to ``n`` samples of ``info`` (all of them when ``n`` is 0), float32, CPU, requiring grad
    where the op supports it.  Chosen greedily for variety from the first 60: each pick adds the
    most features not yet seen -- the input's kind (square matrix, non-square, batched, vector,
    scalar, empty), a dim that 4 ranks split evenly, one they split unevenly, a new set of shapes
    -- so a few samples cover square, non-square, batched, even and uneven inputs."""
    grad = bool(info.supports_autograd)
    pool = list(itertools.islice(info.sample_inputs("cpu", torch.float32, requires_grad=grad), None if n == 0 else 60))
    if n == 0 or len(pool) <= n:
        return pool
    feats = [_features(s) for s in pool]
    seen: set[str] = set()
    picked: list[int] = []
    while len(picked) < n:
        best = max((i for i in range(len(pool)) if i not in picked), key=lambda i: (len(feats[i] - seen), -i))
        picked.append(best)
        seen |= feats[best]
    return [pool[i] for i in sorted(picked)]


def _features(sample: Any) -> set[str]:
    ts = [t for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0] if isinstance(t, torch.Tensor)]
    if not ts:
        return {"no tensor"}
    t = ts[0]
    kind = ("empty" if t.numel() == 0 else "scalar" if t.ndim == 0 else "vector" if t.ndim == 1 else
            "batched" if t.ndim > 2 else "square" if t.shape[0] == t.shape[1] else "non-square")
    dims = [n for x in ts for n in x.shape if n > 1]
    out = {kind, "shapes " + repr([tuple(x.shape) for x in ts])}
    if any(n % 4 == 0 for n in dims):
        out.add("even")
    if any(n % 4 for n in dims):
        out.add("uneven")
    return out


def case_of(info: Any, sample: Any) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    """``(fn, tensors)``: ``fn(*tensors)`` runs the sample's call with its tensors replaced."""
    leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    tensors = [leaves[i].detach().clone() for i in where]
    frozen = [not leaves[i].requires_grad for i in where]  # inputs the op has no gradient for
    post = sample.output_process_fn_grad

    def fn(*ts: Any) -> Any:
        flat = list(leaves)
        for i, t, f in zip(where, ts, frozen):
            flat[i] = t.detach() if f and isinstance(t, torch.Tensor) else t
        inp, args, kwargs = tree_unflatten(flat, spec)
        return post(info.op(inp, *args, **kwargs))

    return fn, tensors


def layouts(name: str, tensors: list[torch.Tensor]) -> list[tuple[str, tuple, tuple]]:
    """``[(label, mesh shape, combo)]``: the cases of layout family ``name`` for these inputs
    (every input Replicate except the one the label names)."""
    k = len(tensors)

    def one(i: int, mesh: tuple, pl: tuple) -> tuple:
        rest = tuple(R for _ in mesh)
        return mesh, tuple(pl if j == i else rest for j in range(k))

    floating = [i for i, t in enumerate(tensors) if t.is_floating_point()]
    shardable = sorted(set(floating) | ({0} if k else set()))
    out: list[tuple[str, tuple, tuple]] = []
    if name == "replicated" and k:
        out.append(("R", *one(-1, (4,), ())))
    elif name == "shard":  # each input in turn on each of its dims
        out += [(f"in{i} S({d})", *one(i, (4,), (Shard(d),))) for i in shardable for d in range(tensors[i].ndim)]
    elif name == "partial":
        out += [(f"in{i} P", *one(i, (4,), (Partial("sum"),))) for i in floating]
    elif name == "2d":  # two different shard dims, and a shard with a partial, on (2, 2)
        for i in shardable:
            t = tensors[i]
            if t.ndim >= 2:
                out.append((f"in{i} (S(0),S({t.ndim - 1}))", *one(i, (2, 2), (Shard(0), Shard(t.ndim - 1)))))
            if t.ndim >= 1 and t.is_floating_point():
                out.append((f"in{i} (S({t.ndim - 1}),P)", *one(i, (2, 2), (Shard(t.ndim - 1), Partial("sum")))))
    elif name == "strided":  # packed: each rank holds its piece of both halves of a dim
        for i in shardable:
            t = tensors[i]
            out += [(f"in{i} SS({d},2)", *one(i, (4,), (StridedShard(d, 2),))) for d in range(t.ndim)]
            if t.ndim >= 2:
                out.append((f"in{i} (S(0),SS({t.ndim - 1},2))",
                            *one(i, (2, 2), (Shard(0), StridedShard(t.ndim - 1, 2)))))
    elif name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    return out


def classify(fn: Callable[..., Any], tensors: list[torch.Tensor], mesh: tuple, combo: tuple,
             grad: bool, runner: Callable[..., Any] | None = None,
             random: "Random | None" = None) -> tuple[str, str]:
    """One case on one side (``runner``: None for shardtensor, ``torch_world.runner`` for
    PyTorch's DTensor): ``(outcome, first line of the message)``.  ``random``: the op draws
    random numbers, so its results are checked by property (``Random``) instead of by value."""
    kw: dict[str, Any] = {} if random is None else {"compare": random.compare, "grad_compare": random.compare_grad}
    run = functools.partial(opcheck.check, fn, tensors, mesh, combos=[combo], grad=grad, tol=TOL, grad_tol=TOL,
                            runner=runner, **kw)
    try:
        try:
            run()
        except RuntimeError as e:
            if not _first_use_race(e):
                raise
            run()
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


def _first_use_race(e: RuntimeError) -> bool:
    """Torch before 2.13 asserts (``expected != self_interpreter``, c10/core/PyHandleCache.h) when
    two threads dispatch an op to Python for the first time at once: a race in torch's cache of
    the op's Python object, which the simulated world's rank threads can meet.  The cache is
    filled by then, so the case runs once more; torch 2.13 removed the assert."""
    return "self_interpreter" in str(e) and tuple(map(int, torch.__version__.split(".")[:2])) < (2, 13)


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else ""


class Random:
    """What a random op's results must satisfy, learnt from ``RUNS`` dense runs (checked on the
    whole result every rank agrees on): each output's shape and dtype; NaN/inf only where dense
    runs give them; where every element takes at most two values over the dense runs (masks,
    Bernoulli draws, dropout's ``0`` or ``x / (1 - p)``), one of those values (but for a few
    elements, or one in 20: a draw of small probability the dense runs missed); and, where each
    run has at least ``ENOUGH`` values, a median and an interquartile range within the spread of
    the dense runs' own (robust to heavy tails, Cauchy, and to few independent draws, channel
    dropout).
    Gradients: shape, dtype, and finite wherever dense gradients are."""

    RUNS = 16
    ENOUGH = 32

    def __init__(self, runs: list[list[Any]]) -> None:
        self.outs: list[Any] = []
        for k in range(len(runs[0])):
            vals = [r[k] for r in runs]
            if not isinstance(vals[0], torch.Tensor) or vals[0].numel() == 0:
                self.outs.append(None)
                continue
            stack = torch.stack([_real(v) for v in vals])
            lo, hi = stack.min(0).values, stack.max(0).values
            mid = stack.masked_fill(stack.eq(lo) | stack.eq(hi), math.nan)  # a third value anywhere?
            mask = bool(mid.isnan().all())
            per_run = [r[r.isfinite()] for r in stack]
            stats = None
            if all(r.numel() >= self.ENOUGH for r in per_run):  # each run's median and IQR: their natural spread
                ms, qs = zip(*(_median_iqr(r) for r in per_run))
                stats = (min(ms), max(ms), min(qs), max(qs))
            self.outs.append((lo, hi, mask, stats, bool((~stack.isfinite()).any())))

    def compare(self, actual: torch.Tensor, expected: torch.Tensor, k: int) -> None:
        assert actual.dtype == expected.dtype, f"output {k}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"output {k}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        facts = self.outs[k] if k < len(self.outs) else None
        if facts is None:
            return
        lo, hi, mask, stats, nonfinite = facts
        a = _real(actual)
        assert nonfinite or bool(a.isfinite().all()), f"output {k}: NaN or inf where {self.RUNS} dense runs have none"
        if mask:  # a value a few dense runs missed (a Bernoulli draw of small p) is no error; many are
            ok = torch.isclose(a, lo, rtol=1e-5, atol=1e-6) | torch.isclose(a, hi, rtol=1e-5, atol=1e-6)
            bad = int((~ok).sum())
            assert bad <= max(2, a.numel() // 20), f"output {k}: {bad} elements take neither of the two values dense runs give"
        finite = a[a.isfinite()]
        if stats is not None and finite.numel() >= self.ENOUGH:
            m_lo, m_hi, q_lo, q_hi = stats
            m, q = _median_iqr(finite)
            slack = (m_hi - m_lo) + q_hi / 4 + 1e-6 * (abs(m_hi) + 1)
            assert m_lo - slack <= m <= m_hi + slack, f"output {k}: median {m:.4g}, dense runs' in [{m_lo:.4g}, {m_hi:.4g}]"
            assert q_lo / 2 - 1e-6 <= q <= 2 * q_hi + 1e-6, \
                f"output {k}: interquartile range {q:.4g}, dense runs' in [{q_lo:.4g}, {q_hi:.4g}]"

    def compare_grad(self, actual: torch.Tensor, expected: torch.Tensor, k: int) -> None:
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
            f"grad of input {k}: {actual.dtype} {tuple(actual.shape)} != {expected.dtype} {tuple(expected.shape)}"
        assert bool(actual.isfinite()[expected.isfinite()].all()), f"grad of input {k}: NaN or inf where dense has none"


def _real(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return torch.view_as_real(t).double() if t.is_complex() else t.double()


def _median_iqr(x: torch.Tensor) -> tuple[float, float]:
    q = torch.quantile(x.flatten(), torch.tensor([0.25, 0.5, 0.75], dtype=x.dtype))
    return q[1].item(), (q[2] - q[0]).item()


def _comparable(fn: Callable[..., Any], tensors: list[torch.Tensor]) -> "str | Random | None":
    """How to compare a sample: ``"exact"`` (within the sweep's tolerance), by property (a
    ``Random``: an aten op tagged ``nondeterministic_seeded`` ran), or None: a sample dense torch
    refuses, whose two dense runs differ beyond rounding, sparse or other non-strided tensors."""
    if any(t.layout != torch.strided for t in tensors):
        return None
    def run() -> list[Any]:  # on copies: an in-place op writes its inputs (and returns them)
        out = tree_flatten(fn(*[t.clone() for t in tensors]))[0]
        return [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in out]

    try:
        with _SeenOps() as seen:
            fa = run()
        fb = run()
    except Exception:  # noqa: BLE001 - dense torch refuses the sample: nothing to compare
        return None
    if any(isinstance(x, torch.Tensor) and x.layout != torch.strided for x in fa):
        return None
    if not any(torch.Tag.nondeterministic_seeded in op.tags for op in seen.ops):
        # not random: equal runs, or runs that differ in rounding only (threaded LAPACK)
        same = all(not isinstance(x, torch.Tensor) or _same(x, y) or _close(x, y) for x, y in zip(fa, fb))
        return "exact" if same else None
    return Random([fa, fb] + [run() for _ in range(Random.RUNS - 2)])


class _SeenOps(TorchDispatchMode):
    """Records the aten ops a dense run calls."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[Any] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def _close(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.allclose(_real(x), _real(y), rtol=1e-4, atol=1e-5,
                                                                        equal_nan=True)


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal values, NaNs in the same places (floats compared widened: some dtypes have no ``equal``)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.is_floating_point() or x.is_complex():
        wide = torch.complex128 if x.is_complex() else torch.float64
        x, y = x.to(wide), y.to(wide)
        return torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
    return torch.equal(x, y)


def sweep(ops: list[Any], n_samples: int, families: tuple[str, ...], sides: dict[str, Callable[..., Any] | None],
          report: Callable[[str, str, str, str, str], None] | None = None,
          only: Callable[[str], bool] | None = None) -> dict[str, dict[str, Counter]]:
    """Run every case on every side; ``{side: {op name: Counter of outcomes (and of
    "replicated-fail", "random", "even", "uneven")}}`` (refused samples left out).  ``only(label)``
    keeps a subset of each family's cases."""
    per_side: dict[str, dict[str, Counter]] = {side: defaultdict(Counter) for side in sides}
    for info in ops:
        name = _op_name(info)
        try:
            cases = [case_of(info, s) for s in samples(info, n_samples)]
        except Exception as e:  # noqa: BLE001 - the OpInfo cannot build samples on this torch
            if report:
                report("-", name, "-", "skipped", f"samples: {_line(e)}")
            continue
        for fn, tensors in cases:
            how = _comparable(fn, tensors)
            if how is None:
                continue
            random = how if isinstance(how, Random) else None
            partial_inputs: tuple | None = None  # the inputs as the Partial cases take them, and what they draw
            grad = bool(info.supports_autograd) and any(t.is_floating_point() or t.is_complex() for t in tensors)
            for fam in families:
                for label, mesh, combo in layouts(fam, tensors):
                    if only is not None and not only(label):
                        continue
                    ts, rnd = tensors, random
                    if "P" in label:
                        if partial_inputs is None:
                            dy = [_dyadic(t) for t in tensors]
                            partial_inputs = (dy, _comparable(fn, dy) if random is not None else None)
                        ts = partial_inputs[0]
                        rnd = partial_inputs[1] if isinstance(partial_inputs[1], Random) else None
                        if random is not None and rnd is None:
                            continue  # dense torch refuses the rounded sample
                    for side, runner in sides.items():
                        outcome, msg = classify(fn, ts, mesh, combo, grad, runner, rnd)
                        c = per_side[side][name]
                        c[outcome] += 1
                        c["random"] += random is not None
                        c[_evenness(tensors, combo, mesh)] += 1
                        if fam == "replicated" and outcome != "pass":
                            c["replicated-fail"] += 1
                        if report and outcome != "pass":
                            report(side, name, f"{list(mesh)} {label}", outcome, msg)
    return per_side


def _dyadic(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to multiples of 2**-10 (floats): a Partial input's random terms then sum to
    it exactly in any order, so a discontinuous op (``histogram`` at a bin edge) or a steep one
    (``tan`` near a pole) sees the same input as one device, not one a rounding away."""
    return torch.round(t * 1024) / 1024 if t.is_floating_point() else t


def _evenness(tensors: list[torch.Tensor], combo: tuple, mesh: tuple) -> str:
    """``"even"`` when every sharded dim splits evenly over its mesh dims, else ``"uneven"``."""
    for t, pls in zip(tensors, combo):
        for j, p in enumerate(pls):
            if isinstance(p, Shard) and t.shape[p.dim] % mesh[j]:
                return "uneven"
    return "even"


def summary(per_op: dict[str, Counter]) -> dict[str, Any]:
    totals: Counter = Counter()
    for c in per_op.values():
        totals.update({k: c[k] for k in OUTCOMES})
    n = sum(totals.values())
    clean = sum(1 for c in per_op.values() if sum(c[k] for k in OUTCOMES) and c["pass"] == sum(c[k] for k in OUTCOMES))
    return {"cases": n, "pass": totals["pass"], "pass %": 100.0 * totals["pass"] / max(n, 1),
            **{k: totals[k] for k in OUTCOMES if k != "pass"}, "ops": len(per_op),
            "ops passing every case": clean,
            "ops failing with every input replicated": sum(1 for c in per_op.values() if c["replicated-fail"]),
            **{f"cases {k}": sum(c[k] for c in per_op.values()) for k in ("even", "uneven", "random")}}


def _op_name(info: Any) -> str:
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


CHUNK_TIMEOUT = 3600  # seconds for one chunk's subprocess (its cases time out on their own long before)


def _in_chunks(ops: list[Any], size: int, argv: list[str]) -> dict[str, dict[str, Counter]]:
    """The sweep over ``ops``, ``size`` ops per subprocess: PyTorch's hung ranks are threads
    that never end and keep spinning; a subprocess per chunk ends them, so the run stays fast."""
    per_side: dict[str, dict[str, Counter]] = defaultdict(dict)
    rest, skip = [], False
    for a in argv:  # the caller's arguments less --chunk and --ops (each with its value)
        if not skip and a not in ("--chunk", "--ops"):
            rest.append(a)
        skip = not skip and a in ("--chunk", "--ops")
    with tempfile.TemporaryDirectory() as tmp:
        for at in range(0, len(ops), size):
            names = ",".join(_op_name(info) for info in ops[at:at + size])
            dump = os.path.join(tmp, f"{at}.json")
            try:
                done = subprocess.run([sys.executable, __file__, *rest, "--ops", names, "--dump", dump],
                                      timeout=CHUNK_TIMEOUT)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the chunk of ops {names} was still running after {CHUNK_TIMEOUT} s") from None
            if not os.path.exists(dump):
                raise RuntimeError(f"the chunk of ops {names} ended with exit code {done.returncode} and no results")
            with open(dump) as f:
                for side, per_op in json.load(f).items():
                    per_side[side].update({op: Counter(c) for op, c in per_op.items()})
    return per_side


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4, help="samples per op (default 4; 0: every sample)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    ap.add_argument("--ops", default="", help="comma-separated OpInfo names (default: every op)")
    ap.add_argument("--torch", action="store_true", help="also run PyTorch's DTensor on every case, side by side")
    ap.add_argument("--quiet", action="store_true", help="totals only, no line per failing case")
    ap.add_argument("--torch-timeout", type=float, default=30.0,
                    help="seconds before a PyTorch DTensor case counts as a hang (default 30; its hangs dominate the run)")
    ap.add_argument("--chunk", type=int, default=0,
                    help="run the ops in subprocesses of this many ops each (use with --torch: it ends the threads "
                         "of PyTorch's hung ranks, which otherwise keep spinning and slow the rest of the run)")
    ap.add_argument("--dump", help=argparse.SUPPRESS)  # a chunk's subprocess: per-op outcomes as JSON
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    opcheck.TIMEOUT = 30.0
    families = tuple(x for x in args.layouts.split(",") if x)
    ops = float32_ops(set(args.ops.split(",")) if args.ops else None)
    sides: dict[str, Callable[..., Any] | None] = {"shardtensor": None}
    if args.torch:
        import torch_world

        torch_world.TIMEOUT = args.torch_timeout
        sides["torch DTensor"] = torch_world.runner
    t0 = time.time()

    def report(side: str, name: str, lay: str, outcome: str, msg: str) -> None:
        if not args.quiet:
            print(f"{side:13s} {outcome:11s} {name:32s} {lay:24s} {msg}", flush=True)

    if args.chunk > 0:
        per_side = _in_chunks(ops, args.chunk, sys.argv[1:])
    else:
        per_side = sweep(ops, args.samples, families, sides, report)
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(per_side, f)
        sys.stdout.flush()
        os._exit(0)  # without joining PyTorch's hung rank threads, which never end
    print(f"\ntorch {torch.__version__}; {len(ops)} OpInfos with CPU float32 samples; {args.samples} samples; "
          f"layouts {', '.join(families)}; {time.time() - t0:.0f} s\n")
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
