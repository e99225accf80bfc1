"""Auto-sharding: solve time (cold, one process per row) and predicted step time against the best hand plan.

    python benchmarks/autoshard.py [--models demo,gpt,llama3-8b] [--meshes 8;2,4;8,8;4,4,4] [--json FILE]

For every model and mesh, two memory budgets per rank: ``fits`` (1.5 x what full replication
needs: parameters, gradients and AdamW states of the whole model on every rank, plus the largest
activations any plan saves; every plan fits) and ``tight`` (1.05 x the least memory any plan
needs, below replication). Each row runs ``shardtensor.autoshard`` in a fresh Python process
(imports excluded from the time, as a user who already imported torch would see; the import time
is printed once). ``hand`` is the best hand plan (FSDP, HSDP, TP / TP + DP, FSDP x TP) that fits
the budget; ``ratio`` = chosen / best hand plan predicted step time (<= 1: never slower).

There is no PyTorch counterpart in torch itself (its ``autoparallel`` is a separate, experimental
package), so the baseline here is the hand plans, priced by the same model.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "src")

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from shardtensor.auto import autoshard
from shardtensor.examples.models import build
imported = time.perf_counter() - t0
spec, shape, budget = sys.argv[1], tuple(int(k) for k in sys.argv[2].split(",")), sys.argv[3]
names = tuple(f"d{j}" for j in range(len(shape)))
model, batch = build(spec)
budget = None if budget == "none" else float(budget)
t1 = time.perf_counter()
plan = autoshard(model, (shape, names), batch, memory_per_rank=budget)
solve = time.perf_counter() - t1
fits = [(n, p.cost) for n, p in plan.hand if budget is None or p.cost.memory <= budget]
best_hand = min(fits, key=lambda x: x[1].step_s) if fits else None
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"import_s": imported, "solve_s": solve, "step_s": plan.predicted_step_s,
                  "bytes": plan.predicted_bytes_per_rank, "memory": plan.memory_per_rank, "roles": plan.layout.roles(),
                  "blocks": plan.layout.blocks.label(), "root": plan.layout.root.label(),
                  "hand": None if best_hand is None else best_hand[0],
                  "hand_step_s": None if best_hand is None else best_hand[1].step_s,
                  "least_memory": min([p.cost.memory for _, p in plan.hand] + [plan.search.best.cost.memory]),
                  "max_activations": max(p.cost.activations for _, p in plan.hand), "params": params,
                  "runs": plan.search.runs, "plans": plan.search.plans}))
"""


def _child(spec: str, mesh: str, budget: str) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", CHILD, spec, mesh, budget], capture_output=True, text=True, env=env,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{spec} on {mesh} (budget {budget}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="demo,gpt,llama3-8b")
    ap.add_argument("--meshes", default="8;2,4;8,8;4,4,4")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args()
    rows = []
    print("| model | mesh | budget | budget MiB | solve s | chosen roles | blocks / root | step ms | best hand plan | "
          "hand step ms | ratio | bytes/rank MiB | memory MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    imported = []
    for spec in args.models.split(","):
        for mesh in args.meshes.split(";"):
            probe = _child(spec, mesh, "none")
            replicated = probe["params"] * (1 + 1 + 4) + probe["max_activations"]  # + grads + AdamW in fp32 (2 x 2)
            budgets = {"fits": 1.5 * replicated, "tight": 1.05 * probe["least_memory"]}
            for label, budget in budgets.items():
                r = _child(spec, mesh, repr(budget))
                imported.append(r["import_s"])
                ratio = r["step_s"] / r["hand_step_s"] if r["hand_step_s"] else float("nan")
                rows.append(dict(r, model=spec, mesh=mesh, budget=label, budget_bytes=budget, ratio=ratio))
                print(f"| {spec} | ({mesh}) | {label} | {_mib(budget)} | {r['solve_s']:.2f} | {r['roles']} | "
                      f"{r['blocks']} / {r['root']} | {r['step_s'] * 1e3:.2f} | {r['hand'] or 'none fits'} | "
                      f"{(r['hand_step_s'] or float('nan')) * 1e3:.2f} | {ratio:.3f} | {_mib(r['bytes'])} | "
                      f"{_mib(r['memory'])} |", flush=True)
    print(f"\nimport time (torch + shardtensor), per process: {min(imported):.2f}-{max(imported):.2f} s; "
          f"solve time max {max(r['solve_s'] for r in rows):.2f} s; worst ratio {max(r['ratio'] for r in rows if r['ratio'] == r['ratio']):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
