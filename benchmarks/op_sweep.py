"""Differential sweep: ops x random input placements, each case checked against dense torch.

    python benchmarks/op_sweep.py                 # every op, 12 placement draws per op and mesh
    python benchmarks/op_sweep.py --draws 4       # quicker
    python benchmarks/op_sweep.py --seed 7        # a fresh sample

Each case runs one op with one combination of input placements (Replicate, Shard of every
dim, Partial of the kinds the dtype allows; uneven sizes; meshes (4,) and (2, 2)) in the
simulated world, forward and (for float inputs) backward, through the test suite's
``opcheck.check``, and is classified:

* ``pass``: values, dtypes, shapes, local shards and gradients equal dense torch's;
* ``wrong``: a silent difference (the worst outcome);
* ``unsupported``: ``NotImplementedError`` naming the op and placements;
* ``crash``: any other exception;
* ``hang``: a collective timed out (30 s).

Prints one line per failing case and the totals.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time
import warnings
from collections import Counter
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import opcheck  # noqa: E402
from opcheck import data, gen, placement_combos  # noqa: E402

from shardtensor.comm import CollectiveTimeoutError  # noqa: E402

D = "distinct"
OPS: list[tuple[str, Callable[..., Any], list[tuple[str, tuple[int, ...]]], tuple[str, ...]]] = [
    # name, fn, inputs as (data kind, shape), Partial kinds to draw
    ("add", torch.add, [("any", (7, 5)), ("any", (7, 5))], ("sum",)),
    ("mul_bcast", torch.mul, [("any", (7, 5)), ("any", (5,))], ("sum",)),
    ("div", torch.div, [("any", (7, 5)), ("nonzero", (7, 5))], ("sum",)),
    ("where", lambda c, a, b: torch.where(c, a, b), [("bool", (7, 5)), ("any", (7, 5)), ("any", (5,))], ()),
    ("sigmoid", torch.sigmoid, [("any", (7, 3, 5))], ("sum", "max")),
    ("pow", lambda a: a.pow(2), [("any", (7, 5))], ("sum",)),
    ("clamp", lambda a: a.clamp(-0.5, 0.5), [("any", (7, 5))], ("sum", "max")),
    ("bool_and", torch.logical_and, [("bool", (7, 5)), ("bool", (7, 5))], ("max", "min")),
    ("int_add", torch.add, [("int", (7, 5)), ("int", (7, 5))], ("sum", "max")),
    ("int8_mul", lambda a: a.to(torch.int8) * 3, [("int", (7, 5))], ("sum",)),
    ("complex_mul", lambda a, b: torch.complex(a, b) * 2, [("any", (7, 5)), ("any", (7, 5))], ("sum",)),
    ("sum", lambda a: a.sum(), [("any", (7, 5))], ("sum", "max")),
    ("sum1", lambda a: a.sum(1), [("any", (7, 5))], ("sum",)),
    ("mean0", lambda a: a.mean(0), [("any", (7, 5))], ("sum", "avg")),
    ("prod1", lambda a: a.prod(1), [("nonzero", (7, 5))], ("product",)),
    ("amax", lambda a: a.amax(0), [(D, (7, 5))], ("max",)),
    ("max_dim", lambda a: a.max(1), [(D, (7, 5))], ()),
    ("argmin", lambda a: a.argmin(0), [(D, (7, 5))], ()),
    ("var", lambda a: a.var(0), [("any", (7, 5))], ("sum",)),
    ("std_all", lambda a: a.std(), [("any", (7, 5))], ()),
    ("norm", lambda a: a.norm(), [("any", (7, 5))], ("sum",)),
    ("logsumexp", lambda a: a.logsumexp(1), [("any", (7, 5))], ()),
    ("cumsum", lambda a: a.cumsum(0), [("any", (7, 5))], ("sum",)),
    ("any", lambda a: a.any(1), [("bool", (7, 5))], ("max",)),
    ("bool_max", lambda a: a.max(0), [("bool", (7, 5))], ("max",)),
    ("empty_sum", lambda a: a.sum(0), [("any", (3, 0))], ("sum",)),
    ("empty_amax", lambda a: a.amax(1), [("any", (0, 4))], ()),
    ("median", lambda a: a.median(1), [(D, (7, 5))], ()),
    ("kthvalue", lambda a: a.kthvalue(2, 0), [(D, (7, 5))], ()),
    ("mm", torch.mm, [("any", (7, 6)), ("any", (6, 5))], ("sum",)),
    ("bmm", torch.bmm, [("any", (3, 7, 6)), ("any", (3, 6, 5))], ("sum",)),
    ("vec_mat", torch.matmul, [("any", (6,)), ("any", (6, 5))], ("sum",)),
    ("mat_vec", torch.matmul, [("any", (7, 6)), ("any", (6,))], ("sum",)),
    ("addmm", lambda b, x, y: torch.addmm(b, x, y), [("any", (5,)), ("any", (7, 6)), ("any", (6, 5))], ("sum",)),
    ("addmv_bcast", lambda b, x, y: torch.addmv(b, x, y), [("any", (1,)), ("any", (5, 3)), ("any", (3,))], ()),
    ("linear", F.linear, [("any", (7, 6)), ("any", (5, 6)), ("any", (5,))], ("sum",)),
    ("einsum", lambda a, b: torch.einsum("bij,bjk->bik", a, b), [("any", (3, 7, 6)), ("any", (3, 6, 5))], ()),
    ("view", lambda a: a.view(7, 3, 2), [("any", (7, 6))], ("sum",)),
    ("reshape", lambda a: a.reshape(-1), [("any", (7, 6))], ("sum",)),
    ("permute", lambda a: a.permute(2, 0, 1), [("any", (7, 3, 5))], ("sum",)),
    ("flatten", lambda a: a.flatten(1), [("any", (7, 3, 5))], ()),
    ("unsqueeze", lambda a: a.unsqueeze(1), [("any", (7, 5))], ("sum",)),
    ("expand", lambda a: a.expand(3, 7, 5), [("any", (7, 5))], ()),
    ("repeat", lambda a: a.repeat(1, 2, 1, 1, 2), [("any", (6, 5))], ()),
    ("split", lambda a: a.split(2, 1), [("any", (7, 5))], ("sum",)),
    ("cat", lambda a, b: torch.cat([a, b], 1), [("any", (7, 5)), ("any", (7, 3))], ("sum",)),
    ("stack", lambda a, b: torch.stack([a, b], 1), [("any", (7, 5)), ("any", (7, 5))], ()),
    ("narrow", lambda a: a.narrow(0, 2, 4), [("any", (7, 5))], ("sum",)),
    ("select", lambda a: a[3], [("any", (7, 5))], ("sum",)),
    ("index_select", lambda a, i: a.index_select(0, i), [("any", (7, 5)), ("idx7", (4,))], ()),
    ("gather", lambda a, i: a.gather(1, i), [("any", (7, 5)), ("idx5", (7, 3))], ()),
    ("scatter_add", lambda a, i, s: a.scatter_add(1, i, s), [("any", (7, 5)), ("idx5", (7, 3)), ("any", (7, 3))], ()),
    ("masked_fill", lambda a, m: a.masked_fill(m, 0.5), [("any", (7, 5)), ("bool", (7, 5))], ()),
    ("topk", lambda a: a.topk(2, 1), [(D, (7, 5))], ()),
    ("sort", lambda a: a.sort(0), [(D, (7, 5))], ()),
    ("tril", torch.tril, [("any", (7, 5))], ("sum",)),
    ("softmax", lambda a: a.softmax(1), [("any", (7, 5))], ()),
    ("log_softmax0", lambda a: a.log_softmax(0), [("any", (7, 5))], ()),
    ("layer_norm", lambda a, w, b: F.layer_norm(a, (5,), w, b), [("any", (7, 5)), ("pos", (5,)), ("any", (5,))], ()),
    ("gelu", F.gelu, [("any", (7, 5))], ()),
    ("silu", F.silu, [("any", (7, 5))], ()),
    ("cross_entropy", lambda a, t: F.cross_entropy(a, t), [("any", (7, 5)), ("idx5", (7,))], ("sum",)),
    ("nll_none", lambda a, t: F.nll_loss(a, t, reduction="none"), [("any", (7, 5)), ("idx5", (7,))], ()),
    ("embedding", lambda i, w: F.embedding(i, w), [("idx7", (4, 3)), ("any", (7, 5))], ()),
    ("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
     [("any", (3, 5, 6, 4))] * 3, ()),
    ("to_bf16", lambda a: a.to(torch.bfloat16), [("any", (7, 5))], ("sum", "max")),
    ("to_int", lambda a: a.to(torch.int32), [("any", (7, 5))], ("sum",)),
    ("to_f64", lambda a: a.double(), [("any", (7, 5))], ("sum", "avg")),
]


def _value(kind: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if kind.startswith("idx"):
        return torch.randint(0, int(kind[3:]), shape, generator=g)
    return data(kind, shape, g)


def classify(fn, values, mesh, combo, partial) -> tuple[str, str]:
    """One case: (outcome, message)."""
    try:
        opcheck.check(fn, values, mesh, combos=[combo], partial=partial, seed=("sweep", str(combo)))
        return "pass", ""
    except AssertionError as e:
        return "wrong", str(e).splitlines()[0][:160]
    except NotImplementedError as e:
        return "unsupported", str(e).splitlines()[0][:160]
    except (CollectiveTimeoutError, TimeoutError) as e:
        return "hang", str(e)[:160]
    except Exception as e:  # noqa: BLE001 - every other failure is a crash to count
        return "crash", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def sweep(draws: int, seed: int, report: Callable[[str], None] = print) -> Counter:
    """Run every op of ``OPS`` on ``draws`` placement combinations per mesh; the outcome counts."""
    totals: Counter[str] = Counter()
    for name, fn, inputs, partial in OPS:
        g = gen(("sweep", name, seed))
        values = [_value(k, s, g) for k, s in inputs]
        try:
            fn(*values)
        except Exception as e:  # noqa: BLE001 - dense torch refuses the case: nothing to compare
            report(f"skipped     {name:14s} dense torch raises: {e}")
            continue
        for mesh in opcheck.MESHES:
            tensors = [v for v in values if isinstance(v, torch.Tensor)]
            for combo in placement_combos(tensors, mesh, draws, (seed, name), partial):
                outcome, msg = classify(fn, values, mesh, combo, partial)
                totals[outcome] += 1
                if outcome != "pass":
                    report(f"{outcome:11s} {name:14s} mesh {mesh}: {combo}  {msg}")
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=12, help="placement combinations per op and mesh")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    opcheck.TIMEOUT = 30.0
    t0 = time.time()
    totals = sweep(args.draws, args.seed, lambda line: print(line, flush=True))
    n = sum(totals.values())
    print(f"\ntorch {torch.__version__}, {len(OPS)} ops, {n} cases, seed {args.seed}, {time.time() - t0:.0f} s")
    for k in ("pass", "wrong", "unsupported", "crash", "hang"):
        print(f"{k:12s} {totals[k]:5d}  {100.0 * totals[k] / max(n, 1):6.2f}%")


if __name__ == "__main__":
    main()
