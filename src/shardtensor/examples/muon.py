"""A Muon-style optimizer step over FSDP-sharded parameters: whole matrices on one rank each.

    python -m shardtensor.examples.muon                  # simulated world, 4 rank threads
    python -m shardtensor.examples.muon --backend gloo   # 4 gloo processes

Muon orthogonalises each 2-D update with Newton-Schulz iterations: an op on the whole matrix,
not on the row slices FSDP leaves on each rank.  Two ways, both run here:

* FSDP's usual ``Shard(0)``: the step gives every 2-D momentum a ``RaggedShard`` layout with all
  its rows on one rank (``local_units`` one-hot; the matrices dealt out largest first to the
  least loaded rank), runs Newton-Schulz there, and redistributes each update back.  Both moves
  receive exactly what a rank lacks: the owner the rows it does not hold, then every other rank
  its rows of the update; the run prints those bytes against that lower bound.
* FSDP with a ragged layout (``shard_placement_fn=whole_parameters(model, 4)``): every parameter,
  so every momentum, is whole on one rank already; the step moves nothing.  FSDP's gathers pay
  for imbalance only (each rank's block is as long as the largest rank's share): the model is a
  stack of equal layers, which deal out evenly, so they move what ``Shard(0)``'s do.

Both check the trained weights against the same training on one device.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn as nn

from shardtensor import DTensor, RaggedShard, comm, fully_shard, init_device_mesh
from shardtensor.fsdp import deal_largest_first, whole_parameters
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
            owner = dict(zip(map(id, mats), deal_largest_first([p.numel() for p in mats], _ranks(mats))))
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
        holder = _holder(m, owner)
        units = [int(r == holder) for r in range(mesh.size(0))]
        whole = m.redistribute(mesh, [RaggedShard(0, units)])  # all its rows on one rank (no move if so already)
        local = whole.to_local()
        local = newton_schulz(local, steps) * scale if local.numel() else local
        out = DTensor.from_local(local, mesh, whole.placements, shape=m.shape, stride=m.stride(), run_check=False)
        return out.redistribute(mesh, m.placements)  # each rank's rows of the update back


def _holder(m: DTensor, owner: int) -> int:
    """The rank holding all of ``m``'s rows already (a whole-parameter FSDP layout), else ``owner``."""
    pl, k, n = m.placements[0], m.device_mesh.size(0), m.shape[0]
    if pl.tensor_dim() == 0:
        whole = [r for r in range(k) if pl.pieces(n, k, r)[0][0] == n]
        return whole[0] if whole else owner
    return owner


def _ranks(params: list[torch.Tensor]) -> int:
    return params[0].device_mesh.size(0) if params and isinstance(params[0], DTensor) else 1


WIDTH, DEPTH = 32, 8


def _model() -> nn.Module:
    """A stack of equal layers, as a transformer's blocks are: dealt whole, they balance exactly."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def _train(model: nn.Module, steps: int, rank: int = 0, world: int = 1) -> None:
    opt = Muon(model.parameters(), lr=0.02)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, WIDTH, generator=g), torch.randint(0, WIDTH, (16,), generator=g)
        rows = slice(rank * 16 // world, (rank + 1) * 16 // world)  # data parallel: each rank its rows
        # FSDP averages the ranks' gradients: each rank's share of the mean loss, times the ranks
        loss = nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="sum") * world / 16
        loss.backward()
        opt.step()
        opt.zero_grad()


def run_rank(steps: int = 3) -> dict[str, Any]:
    """Train with FSDP and Muon on this rank, once per FSDP layout (``Shard(0)``, whole
    parameters): the bytes the Muon moves and FSDP's collectives moved, the Muon moves' lower
    bound, and whether every weight equals the one-device run's."""
    mesh = init_device_mesh("cpu", (WORLD,))
    me = mesh.get_rank()
    ref = _model()
    _train(ref, steps)
    out: dict[str, Any] = dict(rank=me)
    for layout in ("even", "whole"):
        plain = _model()
        fn = whole_parameters(plain, WORLD) if layout == "whole" else None
        model: Any = fully_shard(plain, mesh=mesh, shard_placement_fn=fn)
        with comm.recording() as log:
            _train(model, steps, me, WORLD)
        mine = [e for e in log.events if e.rank == me]
        mats = [p for p in model.parameters() if p.ndim == 2]
        own = deal_largest_first([p.numel() for p in mats], WORLD)
        bound = gather = 0
        for p, r in zip(mats, own):  # the owner lacks the rows it does not hold; each other rank its own rows
            r = _holder(p, r)
            local = p.to_local().numel()
            bound += (p.numel() - local if r == me else local) * p.element_size() * steps
            gather += (p.numel() - local) * p.element_size() * steps  # full_tensor() on every rank instead
        out[layout] = dict(
            muon=sum(e.bytes_received for e in mine if e.kind == "send_recv"),
            fsdp=sum(e.bytes_received for e in mine if e.kind != "send_recv"), bound=bound, gather=gather,
            exact=all(torch.allclose(p.full_tensor(), q, atol=1e-5) for p, q in zip(model.parameters(), ref.parameters())))
    return out


def report(rows: list[dict[str, Any]], world: str) -> bool:
    ok = True
    for layout, title in (("even", "FSDP Shard(0); each 2-D momentum to a RaggedShard holding its whole matrix"),
                          ("whole", "FSDP with whole parameters per rank (shard_placement_fn=whole_parameters)")):
        print(f"Muon step over {title} ({world}):")
        for row in rows:
            r = row[layout]
            print(f"  rank {row['rank']}: the Muon moves received {r['muon']} B, lower bound {r['bound']} B "
                  f"(every rank orthogonalising every matrix after full_tensor(): {r['gather']} B); "
                  f"FSDP's all-gathers and reduce-scatters {r['fsdp']} B")
        exact = all(row[layout]["exact"] for row in rows)
        at_bound = all(row[layout]["muon"] == row[layout]["bound"] for row in rows)
        print("  every weight equal to one device's Muon training" if exact else "  WRONG weights")
        print("  bytes at the lower bound on every rank" if at_bound else "  bytes above the lower bound")
        ok = ok and exact and at_bound
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
