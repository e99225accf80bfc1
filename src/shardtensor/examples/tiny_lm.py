"""``shardtensor demo``: train a small transformer with FSDP x TP on a (2, 2) mesh.

The mesh is ``("dp", "tp")``: tensor parallelism on "tp" (attention q/k/v and MLP up
column-wise, attention out and MLP down row-wise, the vocabulary head column-wise with a
replicated output) and per-parameter FSDP on "dp" (every block, then the root; parameters
Shard(0) on dp, gathered through one flat buffer per module, gradients reduce-scattered the
same way).  Each dp rank trains on its half of the batch.  Every step prints the loss next to
the loss of the same model trained on one device on the whole batch; at the end come the
collectives by kind (count, bytes per rank) and a picture of where every parameter lives.

Runs in the simulated world by default (4 rank threads, one process); ``--backend gloo``
spawns 4 real gloo processes on localhost, and under ``torchrun --nproc-per-node 4`` the
processes torchrun started are used.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, SEQ, BATCH, LAYERS = 64, 32, 4, 16, 8, 2


@dataclass
class Config:
    steps: int = 6
    lr: float = 1e-2
    seed: int = 0
    device: str = "cpu"


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.hd = d // heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        att = torch.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln2, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Token + position embeddings, ``LAYERS`` blocks, final norm, vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def build_model(seed: int) -> TinyLM:
    """Deterministic initialisation from a private generator (safe inside rank threads)."""
    m = TinyLM()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".ln" in name or name.startswith("ln"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / math.sqrt(p.shape[-1])))
    return m


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable toy task: the next token is the current one plus one (mod the vocabulary)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, (x + 1) % VOCAB


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def reference_losses(cfg: Config) -> list[float]:
    """The same model and data on one device, whole batch."""
    model = build_model(cfg.seed).to(cfg.device)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    out = []
    for s in range(cfg.steps):
        x, y = (t.to(cfg.device) for t in batch(s, cfg.seed))
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def tp_plan() -> dict[str, Any]:
    from shardtensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}


@dataclass
class RankResult:
    losses: list[float]
    comm: dict[str, list[float]] = field(default_factory=dict)
    params: list[tuple[str, tuple[int, ...], str, tuple[int, ...]]] = field(default_factory=list)
    seconds: float = 0.0


def parallelize(model: TinyLM, mesh) -> TinyLM:
    """torch's 2-D recipe: TP on ``mesh["tp"]`` (the blocks' plan, the head column-wise with a
    replicated output), then FSDP on ``mesh["dp"]``: every block, then the root."""
    from shardtensor.fsdp import fully_shard
    from shardtensor.parallel import ColwiseParallel, parallelize_module
    from shardtensor.placement import Replicate

    for blk in model.blocks:
        parallelize_module(blk, mesh["tp"], tp_plan())
    parallelize_module(model, mesh["tp"], {"head": ColwiseParallel(output_layouts=Replicate())})
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def train_rank(cfg: Config, ref: list[float], show: bool) -> RankResult:
    """One rank's part: parallelize, shard, train ``cfg.steps`` Adam steps."""
    from shardtensor import comm
    from shardtensor.mesh import init_device_mesh
    from shardtensor.placement import display

    torch.manual_seed(cfg.seed)
    mesh = init_device_mesh(torch.device(cfg.device).type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    rank = mesh.get_rank()
    model = parallelize(build_model(cfg.seed).to(cfg.device), mesh)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    half = BATCH // 2
    res = RankResult([])
    t0 = time.perf_counter()
    for s in range(cfg.steps):
        x, y = (t.to(cfg.device) for t in batch(s, cfg.seed))
        with comm.CommLog(rank=rank) as log:
            opt.zero_grad()
            loss = loss_of(model, x[dp * half:(dp + 1) * half], y[dp * half:(dp + 1) * half])
            loss.backward()
            opt.step()
        for e in log.events:
            c = res.comm.setdefault(e.kind, [0, 0.0])
            c[0] += 1
            c[1] += e.bytes_sent
        both = comm.all_gather(loss.detach().reshape(1), mesh, 0)
        res.losses.append(both.mean().item())
        if show:
            d = abs(res.losses[-1] - ref[s])
            print(f"step {s + 1}/{cfg.steps}  loss {res.losses[-1]:.6f}  single-device {ref[s]:.6f}  "
                  f"|diff| {d:.1e}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    res.seconds = time.perf_counter() - t0
    for name, p in model.named_parameters():
        p = cast(Any, p)  # a DTensor parameter
        res.params.append((name, tuple(p.shape), display(p.placements, p.shard_order), tuple(p.to_local().shape)))
    return res


def _fmt_bytes(n: float) -> str:
    for unit, size in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def report(results: list[RankResult], ref: list[float], world: str, png: str | None) -> bool:
    """Summary after training: agreement, collectives, parameter placements."""
    r0 = results[0]
    worst = max(abs(a - b) for a, b in zip(r0.losses, ref))
    ok = worst <= 1e-4 and all(r.losses == r0.losses for r in results)
    print(f"\nlosses {'match' if ok else 'DO NOT MATCH'} single-device training (max |diff| {worst:.1e}, "
          f"{len(ref)} steps, {world}, {r0.seconds:.1f} s)")
    print("\ncollectives per rank (rank 0, all steps):")
    print(f"  {'kind':16} {'count':>6} {'bytes sent':>12}")
    for kind, (n, b) in sorted(r0.comm.items()):
        print(f"  {kind:16} {n:6d} {_fmt_bytes(b):>12}")
    print("\nparameter placements on mesh (dp=2, tp=2); local shape per rank r0..r3:")
    width = max(len(n) for n, *_ in r0.params)
    for i, (name, shape, pl, _) in enumerate(r0.params):
        locs = "  ".join(f"{results[r].params[i][3]}" for r in range(len(results)))
        print(f"  {name:{width}}  {str(shape):10} {pl:22} {locs}")
    if png:
        _draw(results, png)
        print(f"\nwrote {png}")
    return ok


def _draw(results: list[RankResult], path: str) -> None:
    """Bar chart: elements each rank holds per parameter (how FSDP x TP splits the model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p[0] for p in results[0].params]
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(names) + 1.5))
    left = [0.0] * len(names)
    for r, res in enumerate(results):
        sizes = [math.prod(p[3]) for p in res.params]
        ax.barh(range(len(names)), sizes, left=left, label=f"rank {r}")
        left = [a + b for a, b in zip(left, sizes)]
    ax.set_yticks(range(len(names)), [f"{p[0]} {p[2]}" for p in results[0].params], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("elements held (stacked over ranks)")
    ax.set_title("FSDP (dp) x TP (tp) on a (2, 2) mesh: parameter pieces per rank")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _process_device(device: str, local_rank: int) -> str:
    """A process's device: ``cuda`` becomes ``cuda:<local rank mod GPU count>`` (ranks may share a GPU)."""
    if torch.device(device).type != "cuda" or torch.device(device).index is not None:
        return device
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: CUDA is not available in this process (torch.cuda.is_available() "
                           "is False); run with --device cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def _gloo_train(rank: int, cfg: Config, ref: list[float]) -> RankResult:
    """One spawned gloo process's part (``examples/spawn.py``)."""
    from dataclasses import replace

    return train_rank(replace(cfg, device=_process_device(cfg.device, rank)), ref, show=rank == 0)


def _torchrun(cfg: Config, backend: str, png: str | None) -> int:
    """Under ``torchrun``: this process is one rank; ``backend`` is gloo (also for CUDA tensors) or nccl."""
    import torch.distributed as dist
    from dataclasses import replace
    from datetime import timedelta

    from shardtensor.comm import DEFAULT_TIMEOUT_S

    device = _process_device(cfg.device, int(os.environ.get("LOCAL_RANK", "0")))
    cfg = replace(cfg, device=device)
    if not dist.is_initialized():  # with shardtensor's collective timeout: a missing rank fails, never hangs
        timeout = timedelta(seconds=DEFAULT_TIMEOUT_S)
        if backend == "nccl":
            dist.init_process_group("nccl", device_id=torch.device(device), timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    ref = reference_losses(cfg)
    if rank == 0:
        print(f"shardtensor demo -- tiny transformer, FSDP (dp) x TP (tp) on a (2, 2) mesh, torchrun, {device}",
              flush=True)
    res = train_rank(cfg, ref, show=rank == 0)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    ok = True
    if rank == 0:
        ok = report(gathered, ref, f"torch.distributed ({dist.get_backend()}, {device})", png)
    dist.destroy_process_group()
    return 0 if ok else 1


def main(backend: str = "sim", steps: int = 6, png: str | None = None, device: str = "cpu") -> int:
    """Entry of ``shardtensor demo``; exit code 0 when the losses match single-device training.

    ``backend``: ``sim`` (4 rank threads), ``gloo`` (4 spawned processes, or torchrun's), or
    ``nccl`` (torchrun only, one GPU per rank).  ``device``: ``cpu`` or ``cuda`` (ranks share the
    GPUs there are, round robin).
    """
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: CUDA is not available (torch.cuda.is_available() is False); "
                           "run with --device cpu")
    cfg = Config(steps=steps, device=device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _torchrun(cfg, "gloo" if backend == "sim" else backend, png)
    if backend == "nccl":
        raise RuntimeError("--backend nccl runs under torchrun (one process per GPU): "
                           "torchrun --nproc-per-node 4 -m shardtensor demo --backend nccl --device cuda")
    ref = reference_losses(cfg)
    if backend == "gloo":
        print(f"shardtensor demo -- tiny transformer, FSDP (dp) x TP (tp) on a (2, 2) mesh, 4 gloo processes, "
              f"{device}", flush=True)
        from shardtensor.examples.spawn import spawn_gloo

        results = spawn_gloo(_gloo_train, 4, (cfg, ref))
        return 0 if report(results, ref, f"4 gloo processes, {device}", png) else 1
    from shardtensor.comm import run_spmd

    print(f"shardtensor demo -- tiny transformer, FSDP (dp) x TP (tp) on a (2, 2) mesh, simulated world (4 ranks), "
          f"{device}", flush=True)
    results = run_spmd(lambda: train_rank(cfg, ref, show=_is_rank0()), 4, timeout=600)
    return 0 if report(results, ref, f"simulated world, {device}", png) else 1


def _is_rank0() -> bool:
    from shardtensor.comm import current_transport

    return current_transport().rank == 0


if __name__ == "__main__":
    sys.exit(main())
