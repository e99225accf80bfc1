"""A Muon-style optimizer step over FSDP-sharded parameters: whole matrices on one rank each.

    python -m shardtensor.examples.muon                  # simulated world, 4 rank threads
    python -m shardtensor.examples.muon --backend gloo   # 4 gloo processes

Muon orthogonalises each 2-D update with Newton-Schulz iterations: an op on the whole matrix,
not on the row slices FSDP leaves on each rank.  The step here gives every 2-D momentum a
``RaggedShard`` layout with all its rows on one rank (``local_units`` one-hot; the matrices are
dealt out largest first to the least loaded rank), runs Newton-Schulz on the matrices each rank
owns, and redistributes each update back to its parameter's layout.  Both moves receive exactly
what a rank lacks: the owner the rows it does not hold, then every other rank its rows of the
update.  The run prints those bytes against that lower bound and checks the trained weights
against the same training on one device.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn as nn

from shardtensor import DTensor, RaggedShard, comm, fully_shard, init_device_mesh
from shardtensor.examples.spawn import run_example

WORLD = 4


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The orthogonal factor of ``g`` by Muon's quintic Newton-Schulz iteration (float32)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float() / (g.float().norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return (x.T if tall else x).to(g.dtype)


def owners(shapes: list[torch.Size], k: int) -> list[int]:
    """A rank for each matrix: largest first, to the rank with the fewest elements so far."""
    load = [0] * k
    out = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -shapes[i].numel()):
        r = min(range(k), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += shapes[i].numel()
    return out


class Muon(torch.optim.Optimizer):
    """Momentum, then each 2-D update orthogonalised on the rank that owns its matrix (plain
    tensors: on this rank); other parameters take the momentum step."""

    def __init__(self, params: Any, lr: float = 0.02, momentum: float = 0.95, ns_steps: int = 5) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            mats = [p for p in params if p.ndim == 2]
            owner = dict(zip(map(id, mats), owners([p.shape for p in mats], _ranks(mats))))
            for p in params:
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)  # elementwise: each rank on its rows
                update = self._orthogonal(buf, owner[id(p)], group["ns_steps"]) if p.ndim == 2 else buf
                p.add_(update, alpha=-group["lr"])

    @staticmethod
    def _orthogonal(m: torch.Tensor, owner: int, steps: int) -> torch.Tensor:
        scale = max(1.0, m.shape[0] / m.shape[1]) ** 0.5
        if not isinstance(m, DTensor):
            return newton_schulz(m, steps) * scale
        mesh = m.device_mesh
        units = [int(r == owner) for r in range(mesh.size(0))]
        whole = m.redistribute(mesh, [RaggedShard(0, units)])  # all its rows on the owner
        local = whole.to_local()
        local = newton_schulz(local, steps) * scale if local.numel() else local
        out = DTensor.from_local(local, mesh, whole.placements, shape=m.shape, stride=m.stride(), run_check=False)
        return out.redistribute(mesh, m.placements)  # each rank's rows of the update back


def _ranks(params: list[torch.Tensor]) -> int:
    return params[0].device_mesh.size(0) if params and isinstance(params[0], DTensor) else 1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 10))


def _train(model: nn.Module, steps: int, rank: int = 0, world: int = 1) -> None:
    opt = Muon(model.parameters(), lr=0.02)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 24, generator=g), torch.randint(0, 10, (16,), generator=g)
        rows = slice(rank * 16 // world, (rank + 1) * 16 // world)  # data parallel: each rank its rows
        # FSDP averages the ranks' gradients: each rank's share of the mean loss, times the ranks
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="sum") * world / 16
        loss.backward()
        opt.step()
        opt.zero_grad()


def run_rank(steps: int = 3) -> dict[str, Any]:
    """Train with FSDP and Muon on this rank; the bytes the Muon moves moved, their lower bound,
    and whether every weight equals the one-device run's."""
    mesh = init_device_mesh("cpu", (WORLD,))
    model = fully_shard(_model(), mesh=mesh)
    me = mesh.get_rank()
    with comm.recording() as log:
        _train(model, steps, me, WORLD)
    moved = sum(e.bytes_received for e in log.events if e.kind == "send_recv" and e.rank == me)
    mats = [p for p in model.parameters() if p.ndim == 2]
    own = owners([p.shape for p in mats], WORLD)
    bound = gather = 0
    for p, r in zip(mats, own):  # the owner lacks the rows it does not hold; each other rank its own rows
        mine = p.to_local().numel()
        bound += (p.numel() - mine if r == me else mine) * p.element_size() * steps
        gather += (p.numel() - mine) * p.element_size() * steps  # full_tensor() on every rank instead
    ref = _model()
    _train(ref, steps)
    exact = all(torch.allclose(p.full_tensor(), q, atol=1e-5)
                for p, q in zip(model.parameters(), ref.parameters()))
    return dict(rank=me, moved=moved, bound=bound, gather=gather, exact=exact)


def report(rows: list[dict[str, Any]], world: str) -> bool:
    print(f"Muon step over FSDP ({world}): each 2-D momentum to a RaggedShard holding its whole matrix on one rank")
    for r in rows:
        print(f"  rank {r['rank']}: received {r['moved']} B for the Muon moves, lower bound {r['bound']} B "
              f"(every rank orthogonalising every matrix after full_tensor(): {r['gather']} B)")
    ok = all(r["exact"] for r in rows) and all(r["moved"] == r["bound"] for r in rows)
    print("  every weight equal to one device's Muon training" if all(r["exact"] for r in rows) else "  WRONG weights")
    print("  bytes at the lower bound on every rank" if ok else "  bytes above the lower bound")
    return ok


def main(backend: str = "sim", steps: int = 3) -> int:
    """Exit code 0 when every weight equals one device's and the bytes are the lower bound."""
    return run_example("muon", run_rank, report, WORLD, backend, (steps,))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="a Muon-style step over FSDP parameters via RaggedShard")
    ap.add_argument("--backend", choices=("sim", "gloo"), default="sim")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    raise SystemExit(main(a.backend, a.steps))
