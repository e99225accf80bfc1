"""Weight sync between meshes after every training step, as an RL loop does it.

    python -m shardtensor.examples.weight_sync                  # simulated world, 8 rank threads
    python -m shardtensor.examples.weight_sync --backend gloo   # 8 gloo processes
    torchrun --nproc-per-node 8 -m shardtensor.examples.weight_sync

The trainer is the demo's tiny transformer with FSDP x TP on a (2, 2) ("dp", "tp") mesh over
ranks 0-3, trained with Adam.  After every step its weights go to two inference layouts:

* **far**: a TP engine on ranks 4-7, a (4,) mesh (q, k, v, up and the head column-wise, o and
  down row-wise, the rest replicated);
* **near**: two TP=2 replicas on the trainer's own ranks laid out across it, a ("replica", "tp")
  mesh ``[[0, 2], [1, 3]]``, each replica's parameters on its ``mesh["tp"]`` (a colocated engine).

The trainer's ranks and the inference ranks run different code, and each side hands only its own
state dict to a ``shardtensor.WeightSync``: the layouts travel once, then every sync is one
bucketed point-to-point exchange whose bytes are the lower bound.  Every step checks every
inference weight exact against the trainer's whole weight (gathered on the trainer and sent whole
by its first rank: the check, not the sync).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from shardtensor import DeviceMesh, DTensor, Placement, Replicate, Shard, WeightSync, comm, distribute_tensor
from shardtensor.examples import tiny_lm
from shardtensor.examples.spawn import run_example

WORLD = 8
TRAINER, FAR, NEAR = [[0, 1], [2, 3]], [4, 5, 6, 7], [[0, 2], [1, 3]]
COLUMNWISE = ("attn.q", "attn.k", "attn.v", "mlp.up", "head")
ROWWISE = ("attn.o", "mlp.down")


def inference_placement(name: str) -> Placement:
    """The inference engine's TP layout of one parameter."""
    module, leaf = name.rsplit(".", 1)
    if module.endswith(COLUMNWISE):
        return Shard(0)
    if module.endswith(ROWWISE) and leaf == "weight":
        return Shard(1)
    return Replicate()


def inference_state(mesh: DeviceMesh, shapes: dict[str, torch.Size]) -> dict[str, DTensor]:
    """An inference model's parameters on ``mesh``, zeroed (stale weights fail the check)."""
    return {k: distribute_tensor(torch.zeros(shape), mesh, [inference_placement(k)]) for k, shape in shapes.items()}


def _trainer_step(model: Any, opt: Any, mesh: DeviceMesh, step: int) -> float:
    x, y = tiny_lm.batch(step, 0)
    half, dp = tiny_lm.BATCH // 2, mesh.get_local_rank("dp")
    opt.zero_grad()
    loss = tiny_lm.loss_of(model, x[dp * half:(dp + 1) * half], y[dp * half:(dp + 1) * half])
    loss.backward()
    opt.step()
    return float(loss.detach())


def _whole_weights(full: dict[str, torch.Tensor] | None, names: list[str], shapes: dict[str, torch.Size]
                   ) -> dict[str, torch.Tensor] | None:
    """The trainer's whole weights on every far rank: its first rank sends them, packed (the check)."""
    me = comm.current_transport().rank
    if me == TRAINER[0][0]:
        assert full is not None
        flat = torch.cat([full[k].reshape(-1) for k in names])
        comm.send_recv([(r, flat) for r in FAR], [])
        return full
    if me in FAR:
        buf = torch.empty(sum(shapes[k].numel() for k in names))
        comm.send_recv([], [(TRAINER[0][0], buf)])
        return dict(zip(names, (p.view(shapes[k]) for k, p in zip(names, buf.split([shapes[k].numel() for k in names])))))
    return full


def run_rank(steps: int) -> list[dict[str, Any]]:
    """One rank's part: train (ranks 0-3), sync to both layouts, check; one row per step."""
    me = comm.current_transport().rank
    trainer = DeviceMesh("cpu", TRAINER, mesh_dim_names=("dp", "tp"))
    far, near = DeviceMesh("cpu", FAR), DeviceMesh("cpu", NEAR, mesh_dim_names=("replica", "tp"))
    to_far, to_near = WeightSync(trainer, far), WeightSync(trainer, near)
    in_trainer = trainer.get_coordinate() is not None
    model = opt = None
    if in_trainer:
        model = tiny_lm.parallelize(tiny_lm.build_model(0), trainer)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    shapes = {k: v.shape for k, v in tiny_lm.build_model(0).state_dict().items()}
    names = sorted(shapes)
    far_sd = inference_state(far, shapes) if me in FAR else None
    near_sd = inference_state(near["tp"], shapes) if near.get_coordinate() is not None else None
    rows: list[dict[str, Any]] = []
    for step in range(steps):
        loss = _trainer_step(model, opt, trainer, step) if in_trainer else float("nan")
        src = model.state_dict() if model is not None else None
        t0 = time.perf_counter()
        with comm.CommLog(rank=me) as log:
            to_far(src=src, out=far_sd)
            to_near(src=src, out=near_sd)
        seconds = time.perf_counter() - t0
        full = {k: v.full_tensor() for k, v in src.items()} if src is not None else None
        whole = _whole_weights(full, names, shapes)
        ok = True
        for sd in (far_sd, near_sd):
            if sd is not None and whole is not None:
                ok &= all(torch.equal(sd[k].full_tensor(), whole[k]) for k in names)
        rows.append({"loss": loss, "sent": sum(e.bytes_sent for e in log.events), "ok": ok, "seconds": seconds})
    if me == 0:
        rows[-1]["lower bound"] = [sum(p.total_bytes for p in sync.plans().values()) for sync in (to_far, to_near)]
    return rows


def report(per_rank: list[list[dict[str, Any]]], world: str) -> bool:
    steps = len(per_rank[0])
    ok = all(row["ok"] for rows in per_rank for row in rows)
    print(f"weight sync: trainer FSDP x TP on {TRAINER} -> TP on {FAR} (far) and TP replicas {NEAR} (near), {world}")
    print(f"  {'step':>4}  {'loss':>9}  {'bytes sent (all ranks)':>23}  {'busiest rank':>13}  {'slowest sync':>13}  exact")
    for s in range(steps):
        sent = [rows[s]["sent"] for rows in per_rank]
        print(f"  {s + 1:>4}  {per_rank[0][s]['loss']:9.5f}  {sum(sent):>23,}  {max(sent):>13,}  "
              f"{max(rows[s]['seconds'] for rows in per_rank) * 1e3:>10.1f} ms  "
              f"{'yes' if all(rows[s]['ok'] for rows in per_rank) else 'NO'}")
    far_lb, near_lb = per_rank[0][-1]["lower bound"]
    print(f"  lower bound per sync: far {far_lb:,} B + near {near_lb:,} B = {far_lb + near_lb:,} B "
          f"({'equal to' if sum(r[-1]['sent'] for r in per_rank) == far_lb + near_lb else 'NOT'} the bytes sent)")
    print("every inference weight exact after every step" if ok else "WRONG WEIGHTS")
    return ok


def main(backend: str = "sim", steps: int = 3) -> int:
    """Exit code 0 when every inference weight was exact after every step."""
    return run_example("weight_sync", run_rank, report, WORLD, backend, (steps,), timeout=600)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="weight sync from an FSDP x TP trainer to TP inference meshes")
    ap.add_argument("--backend", choices=("sim", "gloo"), default="sim")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    sys.exit(main(a.backend, a.steps))
