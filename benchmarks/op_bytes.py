"""Bytes per op, side by side: what shardtensor and PyTorch's DTensor move for the same op on the same inputs.

    python benchmarks/op_bytes.py                      # every OpInfo op, 2 samples, shard/partial/2d layouts
    python benchmarks/op_bytes.py --ops mul,where      # a few ops, by OpInfo name
    python benchmarks/op_bytes.py --samples 4 --layouts shard,partial,2d,strided --chunk 40

Each case is one OpInfo sample (CPU float32) with one layout of its inputs (``opinfo_sweep.py``'s
families: one input ``Shard(d)`` or ``Partial(sum)`` on mesh (4,), ``(Shard(0), Shard(last))`` and
``(Shard(last), Partial(sum))`` on (2, 2); every other input ``Replicate``), run forward once in
each library: shardtensor in its simulated world, PyTorch's DTensor on torch's threaded process
group, from the same local pieces and Partial terms.  Counted: the bytes every rank *receives*
during the op call alone (not building the inputs, not ``full_tensor`` after), summed over ranks,
under the ring model both sides share (all-gather (k-1)x the input, reduce-scatter and
all-to-all (k-1)/k, all-reduce 2(k-1)/k; ours from ``comm.recording()``, PyTorch's from its
functional collectives, as ``redistribute_gloo.py`` counts them).  A case is compared only where
both libraries return the right value (``full_tensor`` against one device, tolerance 1e-3):
random ops and calls that return no tensor (``item``) are left out.

Prints each case where ours receives more, then the totals: cases both right, fewer / equal /
more, and the bytes over those cases.  ``--json FILE`` writes every case.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

from _gloo_setup import ROOT  # noqa: F401  (src/, tests/ and this folder on sys.path)

import torch

import opcheck
import opinfo_sweep as ops_
from shardtensor import comm, run_spmd

SCOPE = "op-bytes"


def _body(api: opcheck.Api, mesh_shape: tuple, case: list, fn: Callable[..., Any],
          count: Callable[[], Any]) -> tuple[list, int]:
    """One rank: build the inputs, run ``fn`` inside ``count()`` (a context whose value, after,
    is this rank's received bytes or None), return (placements and full value per output, bytes)."""
    mesh = api.mesh(tuple(mesh_shape))
    args = [opcheck.make_dtensor(p, mesh, False, api) for p in case]
    with count() as counted:
        outs = opcheck._flat_outputs(fn(*args))
    rec = [(api.placements(o), o.full_tensor().detach()) if isinstance(o, api.dtensor) else None for o in outs]
    return rec, counted()


class _Ours:
    """Around the op call on a simulated rank: a comm scope; bytes come from the world's log."""

    def __enter__(self) -> Callable[[], None]:
        self._cm = comm.scope(SCOPE)
        self._cm.__enter__()
        return lambda: None

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)


class _Theirs:
    """Around the op call on a torch thread: count PyTorch's functional collectives."""

    def __enter__(self) -> Callable[[], int]:
        from redistribute_gloo import CallCounter, _functional_counter_mode

        self.counter = CallCounter()
        self._mode = _functional_counter_mode(self.counter)
        self._mode.__enter__()
        return self.received

    def received(self) -> int:
        if self.counter.unknown:
            raise RuntimeError(f"uncounted collectives: {self.counter.unknown}")
        return self.counter.model_bytes()

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def run_ours(mesh_shape: tuple, case: list, fn: Callable[..., Any]) -> tuple[list, int]:
    with comm.recording() as log:
        per_rank = run_spmd(_body, math.prod(mesh_shape), opcheck.SHARDTENSOR, mesh_shape, case, fn, _Ours,
                            timeout=30)
    got = sum(e.bytes_received for e in log.events if SCOPE in e.scope and e.kind != "barrier")
    return per_rank[0][0], got


def run_theirs(mesh_shape: tuple, case: list, fn: Callable[..., Any]) -> tuple[list, int]:
    import torch_world

    per_rank = torch_world.threaded(math.prod(mesh_shape),
                                    lambda: _body(torch_world.TORCH, mesh_shape, case, fn, _Theirs))
    return per_rank[0][0], sum(b for _, b in per_rank)


def _right(rec: list, dense: list) -> bool:
    if len(rec) != len(dense):
        return False
    for r, d in zip(rec, dense):
        if not isinstance(d, torch.Tensor):
            continue
        if r is None:
            return False
        try:
            opcheck.close(r[1], d.detach(), "output", ops_.TOL)
        except AssertionError:
            return False
    return True


def _side(run: Callable[..., tuple[list, int]], mesh: tuple, case: list, fn: Callable[..., Any],
          dense: list) -> tuple[str, int, str]:
    """(outcome, bytes, output placements) of one library on one case."""
    try:
        rec, nbytes = run(mesh, case, fn)
    except Exception as e:  # noqa: BLE001 - a library that fails the case is left out of the comparison
        return "error", 0, f"{type(e).__name__}: {ops_._line(e)}"
    pls = ",".join("-" if r is None else "(" + ",".join(map(str, r[0])) + ")" for r in rec)
    return ("right" if _right(rec, dense) else "wrong"), nbytes, pls


def cases(names: set[str] | None, n_samples: int, families: tuple[str, ...]) -> list[dict]:
    """Run every case on both sides: one dict per case."""
    rows = []
    for info in ops_.float32_ops(names):
        name = ops_._op_name(info)
        try:
            samples = [ops_.case_of(info, s) for s in ops_.samples(info, n_samples)]
        except Exception:  # noqa: BLE001 - the OpInfo cannot build samples on this torch
            continue
        for k, (fn, tensors) in enumerate(samples):
            if ops_._comparable(fn, tensors) != "exact":  # random, refused by dense torch, or sparse
                continue
            for fam in families:
                for label, mesh, combo in ops_.layouts(fam, tensors):
                    ts = [ops_._dyadic(t) for t in tensors] if "P" in label else tensors
                    g = opcheck.gen(("bytes", name, k, label))
                    case = opcheck.prepare(ts, combo, mesh, g)
                    dense = opcheck._flat_outputs(fn(*[t.clone() for t in ts]))
                    if not any(isinstance(d, torch.Tensor) for d in dense):
                        continue  # a Python number (item, tolist): nothing to compare the bytes for
                    ours = _side(run_ours, mesh, case, fn, dense)
                    theirs = _side(run_theirs, mesh, case, fn, dense)
                    rows.append({"op": name, "sample": k, "layout": f"{list(mesh)} {label}",
                                 "shapes": [list(t.shape) for t in ts],
                                 "ours": ours[0], "ours_bytes": ours[1], "ours_out": ours[2],
                                 "theirs": theirs[0], "theirs_bytes": theirs[1], "theirs_out": theirs[2]})
    return rows


def _in_chunks(names: list[str], size: int, argv: list[str]) -> list[dict]:
    """Each chunk of ops in a subprocess: PyTorch's hung rank threads end with it."""
    rows: list[dict] = []
    rest, skip = [], False
    for a in argv:
        if not skip and a not in ("--chunk", "--ops", "--json"):
            rest.append(a)
        skip = not skip and a in ("--chunk", "--ops", "--json")
    with tempfile.TemporaryDirectory() as tmp:
        for at in range(0, len(names), size):
            dump = os.path.join(tmp, f"{at}.json")
            chunk = ",".join(names[at:at + size])
            subprocess.run([sys.executable, __file__, *rest, "--ops", chunk, "--dump", dump], timeout=3600)
            if not os.path.exists(dump):
                print(f"chunk {chunk}: no results", flush=True)
                continue
            with open(dump) as f:
                rows += json.load(f)
            print(f"... {min(at + size, len(names))}/{len(names)} ops", flush=True)
    return rows


def report(rows: list[dict]) -> dict[str, Any]:
    both = [r for r in rows if r["ours"] == "right" and r["theirs"] == "right"]
    more = [r for r in both if r["ours_bytes"] > r["theirs_bytes"]]
    fewer = [r for r in both if r["ours_bytes"] < r["theirs_bytes"]]
    for r in more:
        print(f"MORE {r['op']:28s} {r['layout']:26s} {str(r['shapes']):28s} ours {r['ours_bytes']:7d} B "
              f"-> {r['ours_out']:24s} torch {r['theirs_bytes']:7d} B -> {r['theirs_out']}")
    return {"cases": len(rows), "both right": len(both), "ours fewer": len(fewer),
            "equal": len(both) - len(more) - len(fewer), "ours more": len(more),
            "ours bytes": sum(r["ours_bytes"] for r in both), "torch bytes": sum(r["theirs_bytes"] for r in both),
            "ours right, torch not": sum(r["ours"] == "right" and r["theirs"] != "right" for r in rows),
            "torch right, ours not": sum(r["theirs"] == "right" and r["ours"] != "right" for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2, help="samples per op (default 2)")
    ap.add_argument("--layouts", default="shard,partial,2d", help="families, from opinfo_sweep.py's")
    ap.add_argument("--ops", default="", help="comma-separated OpInfo names (default: every op)")
    ap.add_argument("--chunk", type=int, default=0, help="ops per subprocess (ends PyTorch's hung threads)")
    ap.add_argument("--json", help="write every case here")
    ap.add_argument("--dump", help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    names = set(args.ops.split(",")) if args.ops else None
    families = tuple(x for x in args.layouts.split(",") if x)
    t0 = time.time()
    if args.chunk > 0:
        rows = _in_chunks([ops_._op_name(i) for i in ops_.float32_ops(names)], args.chunk, sys.argv[1:])
    else:
        rows = cases(names, args.samples, families)
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(rows, f)
        sys.stdout.flush()
        os._exit(0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=0)
    totals = report(rows)
    print(f"\ntorch {torch.__version__}; samples {args.samples}; layouts {', '.join(families)}; "
          f"{time.time() - t0:.0f} s")
    for k, v in totals.items():
        print(f"{k:28s} {v}")


if __name__ == "__main__":
    main()
