"""fully_shard (FSDP2-style) against single-device training.

Every rank builds the same model (deterministic generator init), wraps blocks then the root,
and trains on its quarter of a fixed global batch with the per-rank mean loss; the reference
trains one dense copy on the whole batch with the global mean loss.  Losses (mean over
ranks) and parameters (``full_tensor()``) must agree to ~1e-5 in fp32.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


from shardtensor import DTensor, Replicate, Shard, comm, init_device_mesh, run_spmd  # noqa: E402
from shardtensor.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402

WORLD = 4
STEPS = 5
BATCH = 8        # global batch; each of the 4 ranks gets 2 rows
VOCAB, DIM, SEQ = 11, 12, 7


# ---------------------------------------------------------------------------------------
# models and data (top-level: the gloo test imports them in spawned processes)
# ---------------------------------------------------------------------------------------

class MLP(nn.Module):
    """Linear layers with 7, 3 and 1 output rows: uneven over 4 ranks (2,2,2,1 / 1,1,1,0 / 1,0,0,0)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(5, 7)
        self.l2 = nn.Linear(7, 3)
        self.l3 = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        x = x + self.proj(att @ v)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Tiny(nn.Module):
    """Embedding + positional parameter (7 rows) + 2 blocks + final norm + head (11 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList([Block(DIM) for _ in range(2)])
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def build(kind: str) -> nn.Module:
    """The model with deterministic values (a private generator, safe in rank threads)."""
    m = MLP() if kind == "mlp" else Tiny()
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("weight") and ("ln" in name):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return m


def batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 1, generator=g)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def loss_fn(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if kind == "mlp":
        return ((out.float() - y) ** 2).mean()
    return F.cross_entropy(out.float().reshape(-1, VOCAB), y.reshape(-1))


def make_opt(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if name == "adam_foreach":
        return torch.optim.Adam(params, lr=0.01, foreach=True)
    if name == "adam_fused":
        return torch.optim.Adam(params, lr=0.01, fused=True)
    if name == "adamw_foreach":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, foreach=True)
    if name == "sgd_foreach":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
    raise ValueError(name)


def wrap(kind: str, model: nn.Module, mesh, **kw) -> nn.Module:
    subs = [model.l1, model.l2, model.l3] if kind == "mlp" else list(model.blocks)
    for s in subs:
        fully_shard(s, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def reference(kind: str, opt: str, steps: int = STEPS, param_dtype: torch.dtype | None = None):
    """Single-device training on the global batch: per-step losses and final parameters."""
    model = build(kind)
    o = make_opt(opt, model.parameters())
    losses = []
    for s in range(steps):
        x, y = batch(kind, s)
        o.zero_grad()
        loss = loss_fn(kind, model, x, y)
        loss.backward()
        o.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def rank_train(kind: str, opt: str, steps: int = STEPS, mesh_shape=(WORLD,), wrapper=None, on_grads=None, **kw):
    """One rank: FSDP training on its slice; returns (its losses, full parameters).  ``wrapper``
    replaces ``wrap``; ``on_grads(model)`` is called after each backward."""
    mesh = init_device_mesh("cpu", mesh_shape)
    r, W = mesh.get_rank(), mesh.size()
    model = (wrapper or wrap)(kind, build(kind), mesh, **kw)
    o = make_opt(opt, model.parameters())
    losses = []
    for s in range(steps):
        x, y = batch(kind, s)
        n = BATCH // W
        o.zero_grad()
        loss = loss_fn(kind, model, x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])
        loss.backward()
        if on_grads is not None:
            on_grads(model)
        o.step()
        losses.append(loss.item())
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}


def assert_matches(results, ref, tol: float = 1e-5) -> None:
    ref_losses, ref_params = ref
    mean_losses = [sum(r[0][s] for r in results) / len(results) for s in range(len(ref_losses))]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(ref_losses), rtol=tol, atol=tol)
    for _, params in results:
        assert params.keys() == ref_params.keys()
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], rtol=tol, atol=tol, msg=lambda m: f"{n}: {m}")


# ---------------------------------------------------------------------------------------
# training equals single-device training
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mlp", "tiny"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_training_matches_single_device(kind, opt):
    results = run_spmd(rank_train, WORLD, kind, opt)
    assert_matches(results, reference(kind, opt))


@pytest.mark.parametrize("kind", ["mlp", "tiny"])
def test_one_rank_trains_as_the_plain_model(kind):
    """A dp group of one rank (a single-device run) takes its packed buffers as the gathered and
    reduced ones, with no collective and no copy; it trains exactly as the plain model."""
    assert_matches(run_spmd(rank_train, 1, kind, "adam", 3, (1,)), reference(kind, "adam", 3))


def _frozen_train(model: nn.Module, world: int, rank: int) -> list[torch.Tensor]:
    """SGD steps that freeze a different root parameter each step (same count, same dtypes)."""
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    root = [model.emb.weight, model.pos, model.ln_f.weight, model.head.bias]
    n = BATCH // world
    for s in range(len(root)):
        for i, p in enumerate(root):
            p.requires_grad_(i != s)
        x, y = batch("tiny", s)
        o.zero_grad()
        loss_fn("tiny", model, x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]).backward()
        o.step()
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]


def _frozen_body(world: int):
    mesh = init_device_mesh("cpu", (world,))
    return _frozen_train(wrap("tiny", build("tiny"), mesh), world, mesh.get_rank())


@pytest.mark.parametrize("world", [WORLD, 1])
def test_freezing_a_different_parameter_each_step(world):
    """Each step packs another set of gradients of the same dtypes: each is reduced to its own."""
    want = _frozen_train(build("tiny"), 1, 0)
    for got in run_spmd(_frozen_body, world, world):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_one_rank_bf16_params_take_the_gathered_path():
    """With a param dtype the unsharded parameters are casts, not the shards: still as training."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert_matches(run_spmd(rank_train, 1, "tiny", "sgd", 3, (1,), mp_policy=mp), reference("tiny", "sgd", 3),
                   tol=1e-2)


def _one_rank_alias_body():
    mesh = init_device_mesh("cpu", (1,))
    model = wrap("mlp", build("mlp"), mesh)
    plain = build("mlp")
    x, y = batch("mlp", 0)
    # the forward computes with views of the shards themselves
    seen = {}
    hook = model.l1.register_forward_pre_hook(lambda m, a: seen.update(ptr=m.weight.data_ptr()))
    loss_fn("mlp", model, x, y).backward()
    hook.remove()
    assert seen["ptr"] == model.l1.weight.to_local().data_ptr()
    # values written into the sharded parameters are what the next forward computes with
    new = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
           for i, (n, p) in enumerate(plain.named_parameters())}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.to_local().copy_(new[n])
        for n, p in plain.named_parameters():
            p.copy_(new[n])
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    model.zero_grad()
    loss_fn("mlp", model, x, y).backward()
    loss_fn("mlp", plain, x, y).backward()
    return {n: (p.grad.full_tensor(), dict(plain.named_parameters())[n].grad) for n, p in model.named_parameters()}


def test_one_rank_unsharded_parameters_are_the_shards():
    """On one rank without a cast nothing is gathered or copied: the forward uses the shards."""
    (grads,) = run_spmd(_one_rank_alias_body, 1)
    for n, (got, want) in grads.items():
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("opt", ["sgd_foreach", "adam_foreach", "adam_fused", "adamw_foreach"])
def test_foreach_and_fused_optimizers(opt):
    results = run_spmd(rank_train, WORLD, "mlp", opt, 3)
    assert_matches(results, reference("mlp", opt, 3))


def test_reshard_after_forward_false_matches():
    results = run_spmd(rank_train, WORLD, "tiny", "adam", 3, reshard_after_forward=False)
    assert_matches(results, reference("tiny", "adam", 3))


# ---------------------------------------------------------------------------------------
# layout: DTensor parameters, uneven shards, sharded gradients
# ---------------------------------------------------------------------------------------

def _layout_body():
    mesh = init_device_mesh("cpu", (WORLD,))
    model = wrap("mlp", build("mlp"), mesh)
    x, y = batch("mlp", 0)
    loss_fn("mlp", model, x[:2], y[:2]).backward()
    out = {}
    for n, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), n
        assert p.placements == (Shard(0),) and p.device_mesh == mesh, n
        assert isinstance(p.grad, DTensor) and p.grad.placements == (Shard(0),), n
        assert p.grad.dtype == p.dtype and p.grad.shape == p.shape, n
        out[n] = (tuple(p.to_local().shape), tuple(p.grad.to_local().shape))
    assert all(isinstance(m, FSDPModule) for m in (model, model.l1, model.l2, model.l3))
    assert type(model.l1).__name__ == "FSDPLinear" and isinstance(model.l1, nn.Linear)
    return out


def test_uneven_layout_and_sharded_grads():
    res = run_spmd(_layout_body, WORLD)
    rows = {"l1.weight": [2, 2, 2, 1], "l2.weight": [1, 1, 1, 0], "l3.weight": [1, 0, 0, 0],
            "l1.bias": [2, 2, 2, 1], "l2.bias": [1, 1, 1, 0], "l3.bias": [1, 0, 0, 0]}
    for name, want in rows.items():
        got = [r[name][0][0] for r in res]
        assert got == want, (name, got)
        assert [r[name][1][0] for r in res] == want, name


# ---------------------------------------------------------------------------------------
# communication: one all-gather / reduce-scatter per module; freeing
# ---------------------------------------------------------------------------------------

def _count_body(reshard: bool):
    mesh = init_device_mesh("cpu", (WORLD,))
    model = wrap("tiny", build("tiny"), mesh, reshard_after_forward=reshard)
    o = make_opt("sgd", model.parameters())
    x, y = batch("tiny", 0)
    rank = mesh.get_rank()
    counts = []
    for _ in range(2):
        with comm.CommLog(rank=rank) as log:
            o.zero_grad()
            loss = loss_fn("tiny", model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
            fwd = [e.kind for e in log.events]
            loss.backward()
            o.step()
        kinds = [e.kind for e in log.events]
        counts.append((fwd.count("all_gather"), kinds.count("all_gather"), kinds.count("reduce_scatter"),
                       len(kinds)))
    return counts


@pytest.mark.parametrize("reshard", [True, False])
def test_collective_counts(reshard):
    # 3 modules (root + 2 blocks): one all-gather each in forward; with resharding the two
    # blocks re-gather in backward (the root keeps its parameters); one reduce-scatter each
    for counts in run_spmd(_count_body, WORLD, reshard):
        for fwd_ag, ag, rs, total in counts:
            assert fwd_ag == 3
            assert ag == (5 if reshard else 3)
            assert rs == 3
            assert total == ag + rs


def _free_body():
    mesh = init_device_mesh("cpu", (WORLD,))
    model = wrap("tiny", build("tiny"), mesh)
    x, y = batch("tiny", 0)
    loss = loss_fn("tiny", model, x[:2], y[:2])
    blocks_after_fwd = [[t.untyped_storage().size() for t in b.unsharded_params()] for b in model.blocks]
    root_after_fwd = [t.untyped_storage().size() for t in model.unsharded_params()]
    assert all(not isinstance(p, torch.Tensor) or isinstance(p, DTensor) for p in model.parameters())
    loss.backward()
    all_after_bwd = [t.untyped_storage().size() for m in (model, *model.blocks) for t in m.unsharded_params()]
    with torch.no_grad():
        model(x[:2])
    after_eval = [t.untyped_storage().size() for m in (model, *model.blocks) for t in m.unsharded_params()]
    return blocks_after_fwd, root_after_fwd, all_after_bwd, after_eval


def test_reshard_after_forward_frees_storage():
    for blocks, root, after_bwd, after_eval in run_spmd(_free_body, WORLD):
        assert blocks and all(n == 0 for b in blocks for n in b)
        assert root and all(n > 0 for n in root)            # the root is not resharded after forward
        assert after_bwd and all(n == 0 for n in after_bwd)  # every module reshards after backward
        assert after_eval and all(n == 0 for n in after_eval)


# ---------------------------------------------------------------------------------------
# mixed precision
# ---------------------------------------------------------------------------------------

def _mp_body():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    losses, params = rank_train("tiny", "sgd", 3, mp_policy=mp)
    mesh = init_device_mesh("cpu", (WORLD,))
    model = wrap("tiny", build("tiny"), mesh, mp_policy=mp)
    x, y = batch("tiny", 0)
    with comm.CommLog(rank=mesh.get_rank()) as log:
        loss_fn("tiny", model, x[:2], y[:2]).backward()
    dtypes = {(e.kind, e.dtype) for e in log.events}
    sharded = {(p.dtype, p.grad.dtype, p.to_local().dtype) for p in model.parameters()}
    return losses, params, dtypes, sharded


def test_mixed_precision_bf16_params_fp32_reduce():
    out = run_spmd(_mp_body, WORLD)
    ref = reference("tiny", "sgd", 3)
    # bf16 compute (8-bit mantissa): after 3 SGD steps losses differ by ~2e-3 and parameters by
    # ~1e-3 from fp32 training; allow 1e-2
    assert_matches([(o[0], o[1]) for o in out], ref, tol=1e-2)
    for _, _, dtypes, sharded in out:
        assert dtypes == {("all_gather", torch.bfloat16), ("reduce_scatter", torch.float32)}
        assert sharded == {(torch.float32, torch.float32, torch.float32)}


# ---------------------------------------------------------------------------------------
# misc behaviour
# ---------------------------------------------------------------------------------------

def _accum_body(world: int = WORLD):
    mesh = init_device_mesh("cpu", (world,))
    r, n = mesh.get_rank(), BATCH // world
    model = wrap("mlp", build("mlp"), mesh)
    for s in range(2):  # two micro-batches accumulate into .grad
        x, y = batch("mlp", s)
        (loss_fn("mlp", model, x[n * r:n * r + n], y[n * r:n * r + n]) / 2).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [WORLD, 1])
def test_gradient_accumulation(world):
    model = build("mlp")
    for s in range(2):
        x, y = batch("mlp", s)
        (loss_fn("mlp", model, x, y) / 2).backward()
    for grads in run_spmd(_accum_body, world, world):
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)


def _errors_body():
    mesh = init_device_mesh("cpu", (WORLD,))
    m = fully_shard(nn.Linear(3, 3), mesh=mesh)
    errs = []
    for fn in (lambda: fully_shard(m, mesh=mesh), lambda: fully_shard(object(), mesh=mesh),
               lambda: fully_shard(nn.Linear(2, 2), mesh=mesh, mp_policy="bf16")):
        try:
            fn()
        except (RuntimeError, TypeError) as e:
            errs.append(type(e).__name__)
    return errs


def test_errors():
    assert run_spmd(_errors_body, WORLD)[0] == ["RuntimeError", "TypeError", "TypeError"]


class Mixed(nn.Module):
    """fp32 and fp64 parameters plus a frozen int64 one: the all-gather travels as bytes."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w32 = nn.Parameter(torch.randn(7, 3, generator=g))
        self.w64 = nn.Parameter(torch.randn(3, 2, generator=g, dtype=torch.float64))
        self.idx = nn.Parameter(torch.tensor([1, 0, 1, 1, 0]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x @ self.w32.T)[:, :3].double() @ self.w64
        return h[self.idx].sum()


def _mixed_body():
    mesh = init_device_mesh("cpu", (WORLD,))
    m = fully_shard(Mixed(), mesh=mesh)
    seen = {}
    m.register_forward_pre_hook(lambda mod, a: seen.update({n: t.detach().clone() for n, t in mod._parameters.items()}))
    x = torch.arange(6.0).reshape(2, 3) / 7
    with comm.CommLog(rank=mesh.get_rank()) as log:
        m(x).backward()
    return seen, {n: p.grad for n, p in m.named_parameters() if p.requires_grad and p.grad is not None}, \
        {n: p.grad.full_tensor() for n, p in m.named_parameters() if p.grad is not None}, \
        [(e.kind, e.dtype) for e in log.events]


def test_mixed_dtypes_round_trip_bit_exact():
    ref = Mixed()
    x = torch.arange(6.0).reshape(2, 3) / 7
    ref(x).backward()
    for seen, _, grads, events in run_spmd(_mixed_body, WORLD):
        for n, p in ref.named_parameters():
            assert seen[n].dtype == p.dtype and torch.equal(seen[n], p.detach()), n
        assert grads.keys() == {"w32", "w64"}
        torch.testing.assert_close(grads["w32"], ref.w32.grad)
        torch.testing.assert_close(grads["w64"], ref.w64.grad)
        assert events == [("all_gather", torch.uint8), ("reduce_scatter", torch.float64)]


def _fp16_body():
    mesh = init_device_mesh("cpu", (WORLD,))
    r = mesh.get_rank()
    model = wrap("mlp", build("mlp"), mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    x, y = batch("mlp", 0)
    loss_fn("mlp", model, x[2 * r:2 * r + 2], y[2 * r:2 * r + 2]).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_fp16_sum_reduction_with_divide_factors():
    model = build("mlp")
    x, y = batch("mlp", 0)
    loss_fn("mlp", model, x, y).backward()
    for grads in run_spmd(_fp16_body, WORLD):
        for n, p in model.named_parameters():
            assert grads[n].dtype == torch.float32
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-2, atol=2e-3)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(t))))


def _tied_body():
    mesh = init_device_mesh("cpu", (WORLD,))
    r = mesh.get_rank()
    m = Tied()
    fully_shard(m.mid, mesh=mesh)
    fully_shard(m, mesh=mesh)
    assert m.head.weight is m.emb.weight
    x, y = batch("tiny", 0)
    F.cross_entropy(m(x[2 * r:2 * r + 2]).reshape(-1, VOCAB), y[2 * r:2 * r + 2].reshape(-1)).backward()
    bad = Tied()
    fully_shard(bad.head, mesh=mesh)
    try:
        fully_shard(bad, mesh=mesh)
        err = None
    except NotImplementedError as e:
        err = str(e)
    return {n: p.grad.full_tensor() for n, p in m.named_parameters()}, err


def test_tied_weights_in_one_group_and_error_across_groups():
    ref = Tied()
    x, y = batch("tiny", 0)
    F.cross_entropy(ref(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    for grads, err in run_spmd(_tied_body, WORLD):
        assert grads.keys() == {"emb.weight", "mid.weight", "mid.bias"}
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)
        assert err is not None and "shared with the child fully_shard" in err


class Twice(nn.Module):
    """One block applied twice per forward: two live unsharded handles of one group at once."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blk = Block(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blk(self.blk(self.emb(tokens))))


def _seeded(m: nn.Module, scale: float, seed: int = 7) -> nn.Module:
    """``m`` with every parameter drawn from a private generator (safe in rank threads)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=g))
    return m


def _twice_build() -> nn.Module:
    return _seeded(Twice(), 0.3)


def _twice_train(model: nn.Module, rows: slice, full) -> tuple[list[float], list[torch.Tensor]]:
    """SGD steps where one step backpropagates twice (``retain_graph``) and every step ends with a
    no-grad forward: the handles of one group are reused across forwards, never within one."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, evals = [], []
    for s in range(3):
        x, y = batch("tiny", s)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[rows]).float().reshape(-1, VOCAB), y[rows].reshape(-1))
        if s == 1:
            loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        with torch.no_grad():
            evals.append(full(model(x[rows])))
    return losses, evals


def _twice_body(world: int = WORLD):
    mesh = init_device_mesh("cpu", (world,))
    m = _twice_build()
    fully_shard(m.blk, mesh=mesh)
    fully_shard(m, mesh=mesh)
    n = BATCH // world
    r = mesh.get_local_rank()
    losses, evals = _twice_train(m, slice(r * n, (r + 1) * n), lambda t: t.detach().clone())
    return losses, evals, {k: p.full_tensor() for k, p in m.named_parameters()}


@pytest.mark.parametrize("world", [WORLD, 1])
def test_block_called_twice_retain_graph_and_eval_match_single_device(world):
    ref = _twice_build()
    ref_losses, ref_evals = _twice_train(ref, slice(None), lambda t: t.detach().clone())
    results = run_spmd(_twice_body, world, world)
    n = BATCH // world
    mean = [sum(r[0][s] for r in results) / world for s in range(3)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    for rank, (_, evals, params) in enumerate(results):
        for got, want in zip(evals, ref_evals):
            torch.testing.assert_close(got, want[rank * n:(rank + 1) * n], rtol=1e-5, atol=1e-5)
        for k, p in ref.named_parameters():
            torch.testing.assert_close(params[k], p.detach(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# FSDP x TP on a (2, 2) mesh
# ---------------------------------------------------------------------------------------

class TPMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 14)     # colwise: S(0) on tp (7 rows each), FSDP nests 4+3 inside
        self.down = nn.Linear(14, 6)   # rowwise: S(1) on tp, bias Replicate
        self.norm = nn.LayerNorm(6)    # not TP: plain, (S(0), R) on the 2-D mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


def _tp_build() -> nn.Module:
    return _seeded(TPMLP(), 0.4)


def _tp_batch(step: int):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 6, generator=g)


def _tp_reference(steps: int, only_up: bool = False, device: str = "cpu"):
    """Single-device training of TPMLP: Adam on every parameter, or (``only_up``) SGD on ``up``
    alone with the rest frozen; per-step losses and the trained parameters."""
    model = _tp_build().to(device)
    if only_up:
        model.down.requires_grad_(False)
        model.norm.requires_grad_(False)
        o: torch.optim.Optimizer = torch.optim.SGD(model.up.parameters(), lr=0.1)
    else:
        o = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for s in range(steps):
        x, y = (t.to(device) for t in _tp_batch(s))
        o.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        o.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters() if not only_up or n.startswith("up.")}


def _tp_body(steps: int, form: str = "torch", device: str = "cpu"):
    """torch's 2-D recipe (TP on mesh["tp"], then fully_shard on mesh["dp"]) or the ("dp", "tp") form."""
    from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    model = _tp_build().to(device)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"] if form == "torch" else mesh)
    o = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for s in range(steps):
        x, y = (t.to(device) for t in _tp_batch(s))
        n = BATCH // 2
        o.zero_grad()
        loss = ((model(x[dp * n:(dp + 1) * n]) - y[dp * n:(dp + 1) * n]) ** 2).mean()
        loss.backward()
        o.step()
        losses.append(loss.item())
    layout = {n: (p.placements, p.shard_order, tuple(p.to_local().shape), p.device_mesh.mesh_dim_names)
              for n, p in model.named_parameters()}
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}, layout


@pytest.mark.parametrize("form", ["torch", "dp_tp"])
def test_fsdp_x_tp_2d(form):
    pytest.importorskip("shardtensor.parallel")
    steps = 3
    out = run_spmd(_tp_body, WORLD, steps, form)
    # each dp rank's loss appears on its 2 tp ranks: the mean over all 4 is the dp mean
    assert_matches([(r[0], r[1]) for r in out], _tp_reference(steps), tol=1e-5)
    layout = [r[2] for r in out]
    assert layout[0]["up.weight"][0] == (Shard(0), Shard(0))
    assert layout[0]["up.weight"][1] == ((0, (1, 0)),)          # tp splits first, dp nests inside
    assert [lay["up.weight"][2][0] for lay in layout] == [4, 4, 3, 3]   # rank = 2*dp + tp
    assert layout[0]["down.weight"][0] == (Shard(0), Shard(1))
    assert layout[0]["up.weight"][3] == ("dp", "tp")
    if form == "torch":  # a plain parameter stays on the FSDP mesh, as in torch
        assert layout[0]["norm.weight"][0] == (Shard(0),) and layout[0]["norm.weight"][3] == ("dp",)
    else:
        assert layout[0]["norm.weight"][0] == (Shard(0), Replicate())


def tp_train(model: nn.Module, steps: int, part: int, parts: int) -> list[float]:
    """Adam on TPMLP over ``steps`` batches, this rank taking part ``part`` of ``parts`` of each: its losses."""
    o = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for s in range(steps):
        x, y = _tp_batch(s)
        n = BATCH // parts
        o.zero_grad()
        loss = ((model(x[part * n:(part + 1) * n]) - y[part * n:(part + 1) * n]) ** 2).mean()
        loss.backward()
        o.step()
        losses.append(loss.item())
    return losses


def _hsdp_body(steps: int, mesh_shape, names, tp: bool):
    """HSDP: fully_shard on a 2-D (replicate, shard) mesh; with ``tp`` a third mesh dim for TP."""
    from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = _tp_build()
    if tp:
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp_mesh = mesh["rep", "shard"]
    else:
        dp_mesh = mesh
    fully_shard(model.up, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    coord = mesh.get_coordinate()
    part, parts = coord[0] * mesh_shape[1] + coord[1], mesh_shape[0] * mesh_shape[1]
    with comm.recording() as log:
        losses = tp_train(model, steps, part, parts)
    me = comm.current_transport().rank
    kinds = sorted({(e.kind, e.mesh_dim) for e in log.of_rank(me) if e.kind in ("all_gather", "reduce_scatter")
                    or (e.kind == "all_reduce" and e.group_size == mesh_shape[0] and e.dtype == torch.float32)})
    layout = {n: p.placements for n, p in model.named_parameters()}
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}, layout, kinds


@pytest.mark.parametrize("tp", [False, True])
def test_hsdp_replicates_over_dim_0_and_shards_over_dim_1(tp):
    """torch's meaning of a 2-D fully_shard mesh; gradients are averaged over both dims."""
    steps = 3
    shape, names = ((2, 2, 2), ("rep", "shard", "tp")) if tp else ((2, 2), ("rep", "shard"))
    out = run_spmd(_hsdp_body, math.prod(shape), steps, shape, names, tp)
    assert_matches([(r[0], r[1]) for r in out], _tp_reference(steps), tol=1e-5)
    layout, kinds = out[0][2], out[0][3]
    assert layout["norm.weight"] == (Replicate(), Shard(0))
    assert layout["up.weight"] == ((Replicate(), Shard(0), Shard(0)) if tp else (Replicate(), Shard(0)))
    # gathers and reduce-scatters over the shard dim only; the replicas' average is one all-reduce over dim 0
    assert ("all_gather", 1) in kinds and ("reduce_scatter", 1) in kinds and ("all_reduce", 0) in kinds
    assert not any(k in ("all_gather", "reduce_scatter") and d == 0 for k, d in kinds)


def test_tp_params_on_an_unrelated_mesh_or_a_3d_fsdp_mesh_raise():
    from shardtensor import distribute_tensor

    def body():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        other = init_device_mesh("cpu", (4,))
        m = nn.Linear(4, 4)
        m.bias = nn.Parameter(distribute_tensor(m.bias.detach(), other, [Shard(0)]))
        weight = m.weight
        with pytest.raises(ValueError, match="same parent mesh"):
            fully_shard(m, mesh=mesh["dp"])
        assert m.weight is weight and not isinstance(m, FSDPModule)  # the weight before it is untouched
        cube = init_device_mesh("cpu", (1, 2, 2))
        with pytest.raises(NotImplementedError, match="1-D mesh .FSDP. or a 2-D mesh .HSDP"):
            fully_shard(nn.Linear(2, 2), mesh=cube)
        return True

    assert all(run_spmd(body, WORLD))


def _tp_2d_param_body(steps: int):
    """TP parameters given on the 2-D mesh (Replicate on dp); the forward computes on that mesh."""
    from shardtensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    model = _tp_build()
    with torch.no_grad():
        model.up.weight = nn.Parameter(distribute_tensor(model.up.weight, mesh, [Replicate(), Shard(0)]))
        model.up.bias = nn.Parameter(distribute_tensor(model.up.bias, mesh, [Replicate(), Shard(0)]))
    fully_shard(model.up, mesh=mesh)
    model.down.requires_grad_(False)
    model.norm.requires_grad_(False)
    o = torch.optim.SGD(model.up.parameters(), lr=0.1)
    losses = []
    for s in range(steps):
        x, y = _tp_batch(s)
        n = BATCH // 2
        o.zero_grad()
        xd = DTensor.from_local(x[dp * n:(dp + 1) * n], mesh, [Replicate(), Replicate()])
        h = torch.relu(model.up(xd)).full_tensor()
        loss = ((model.norm(model.down(h)) - y[dp * n:(dp + 1) * n]) ** 2).mean()
        loss.backward()
        o.step()
        losses.append(loss.item())
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()) for n, p in model.named_parameters()}
    return losses, {n: v for n, v in full.items() if n.startswith("up.")}, model.up.weight.placements


def test_tp_params_on_the_2d_mesh():
    out = run_spmd(_tp_2d_param_body, WORLD, 2)
    assert_matches([(r[0], r[1]) for r in out], _tp_reference(2, only_up=True))
    assert out[0][2] == (Shard(0), Shard(0))


# ---------------------------------------------------------------------------------------
# real processes
# ---------------------------------------------------------------------------------------

def gloo_rank(rank: int, world_size: int):
    return (rank_train("mlp", "adam", 3), _tp_body(3, "torch")[:2],
            _hsdp_body(3, (2, 2), ("rep", "shard"), False)[:2], _meta_body(3, "fsdp_tp"))



def test_gloo_four_processes():
    try:
        from distributed import gloo_available, run_multiprocess
    except ImportError:  # pragma: no cover
        from tests.distributed import gloo_available, run_multiprocess
    if not gloo_available():
        pytest.skip("gloo is not available")
    results = run_multiprocess(gloo_rank, WORLD, timeout=90)
    assert_matches([r[0] for r in results], reference("mlp", "adam", 3))
    assert_matches([r[1] for r in results], _tp_reference(3))  # torch's 2-D recipe
    assert_matches([r[2] for r in results], _tp_reference(3))  # HSDP
    assert_matches([r[3] for r in results], _meta_reference(3))  # built on meta, TP + FSDP


# ---------------------------------------------------------------------------------------
# gradient accumulation without communication
# ---------------------------------------------------------------------------------------

def _accumulate_body(micro: int, form: str):
    """``micro`` backwards, all but the last without gradient sync; grads and reduce-scatter counts."""
    mesh = init_device_mesh("cpu", (WORLD,)) if form == "1d" else \
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    if form == "1d":
        model = wrap("mlp", build("mlp"), mesh)
        part, parts = mesh.get_local_rank(), WORLD
    else:
        from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = _tp_build()
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model.up, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        part, parts = mesh.get_local_rank("dp"), 2
    counts = []
    for s in range(micro):
        x, y = batch("mlp", s) if form == "1d" else _tp_batch(s)
        n = x.shape[0] // parts
        model.set_requires_gradient_sync(s == micro - 1)
        with comm.recording() as log:
            out = model(x[part * n:(part + 1) * n])
            ((out - y[part * n:(part + 1) * n]) ** 2).mean().backward()
        counts.append(sum(e.kind == "reduce_scatter" for e in log.of_rank(comm.current_transport().rank)))
        if s < micro - 1:
            assert all(p.grad is None for p in model.parameters())
    return counts, {n: p.grad.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("form", ["1d", "2d"])
def test_set_requires_gradient_sync_accumulates_without_communication(form):
    micro = 3
    out = run_spmd(_accumulate_body, WORLD, micro, form)
    model = build("mlp") if form == "1d" else _tp_build()
    for s in range(micro):
        x, y = batch("mlp", s) if form == "1d" else _tp_batch(s)
        ((model(x) - y) ** 2).mean().backward()
    for counts, grads in out:
        assert counts[:-1] == [0] * (micro - 1) and counts[-1] > 0
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


# ---------------------------------------------------------------------------------------
# prefetch: the next all-gather is issued before it is needed, results unchanged
# ---------------------------------------------------------------------------------------

def _prefetch_body(steps: int, prefetch: bool):
    mesh = init_device_mesh("cpu", (WORLD,))
    model = wrap("tiny", build("tiny"), mesh)
    groups = [m._fsdp_state.group for m in model.modules() if isinstance(m, FSDPModule)]
    if not prefetch:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_modules_to_forward_prefetch([])
                m.set_modules_to_backward_prefetch([])
    o = make_opt("adam", model.parameters())
    hits = []
    for s in range(steps):
        x, y = batch("tiny", s)
        n = BATCH // WORLD
        r = mesh.get_local_rank()
        before = sum(g.prefetch_hits for g in groups)
        o.zero_grad()
        loss_fn("tiny", model, x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]).backward()
        o.step()
        hits.append(sum(g.prefetch_hits for g in groups) - before)
    return hits, {k: p.full_tensor() for k, p in model.named_parameters()}


def test_prefetch_overlaps_the_next_gather_and_changes_no_value():
    """Each all-gather but the first of a forward or backward is issued one module early.
    Values are bit for bit those without prefetch."""
    with_p = run_spmd(_prefetch_body, WORLD, 3, True)
    without = run_spmd(_prefetch_body, WORLD, 3, False)
    for (hits, params), (hits0, params0) in zip(with_p, without):
        # backward from the first step on: root's backward re-gathers block 1, block 1's block 0;
        # forward from the second step (the first records the order): root -> block 0 -> block 1
        assert hits0 == [0, 0, 0] and hits == [2, 4, 4]
        assert all(torch.equal(params[k], params0[k]) for k in params)


# ---------------------------------------------------------------------------------------
# meta-device initialization: build on meta, shard, then to_empty and a seeded init
# ---------------------------------------------------------------------------------------

def _seeded_init(model: nn.Module, seed: int = 11) -> nn.Module:
    """torchtitan's order: one seed, then every module's reset_parameters in module order."""
    torch.manual_seed(seed)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return model


def _meta_reference(steps: int):
    model = _seeded_init(TPMLP())
    o = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for s in range(steps):
        x, y = _tp_batch(s)
        o.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        o.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _meta_body(steps: int, layout: str):
    from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    two_d = layout in ("hsdp", "fsdp_tp")
    names = ("rep", "shard") if layout == "hsdp" else ("dp", "tp")
    mesh = init_device_mesh("cpu", (2, 2) if two_d else (WORLD,), mesh_dim_names=names if two_d else None)
    with torch.device("meta"):
        model = TPMLP()
    if layout in ("tp", "fsdp_tp"):
        parallelize_module(model, mesh["tp"] if two_d else mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if layout != "tp":
        dp_mesh = mesh["dp"] if layout == "fsdp_tp" else mesh
        fully_shard(model.up, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    _seeded_init(model)
    coord = mesh.get_coordinate()
    part, parts = {"fsdp": lambda: (coord[0], WORLD), "hsdp": lambda: (2 * coord[0] + coord[1], WORLD),
                   "tp": lambda: (0, 1), "fsdp_tp": lambda: (coord[0], 2)}[layout]()
    losses = tp_train(model, steps, part, parts)
    return losses, {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "tp", "fsdp_tp"])
def test_meta_device_init_trains_as_one_device_initialised_alike(layout):
    """torchtitan's recipe: build under torch.device("meta"), fully_shard and/or
    parallelize_module, then to_empty and a seeded reset_parameters: the values equal one device's
    with the same seed, and training matches it."""
    steps = 3
    out = run_spmd(_meta_body, WORLD, steps, layout)
    assert_matches(out, _meta_reference(steps), tol=1e-5)


def test_distribute_tensor_of_a_meta_tensor():
    def body():
        mesh = init_device_mesh("cpu", (WORLD,))
        from shardtensor import distribute_tensor

        x = distribute_tensor(torch.empty(7, 3, device="meta"), mesh, [Shard(0)])
        assert x.device.type == "meta" and x.to_local().device.type == "meta" and x.shape == (7, 3)
        y = torch.empty_like(x, device="cpu")
        assert y.to_local().device.type == "cpu" and y.placements == (Shard(0),)
        return tuple(x.to_local().shape), tuple(y.to_local().shape)

    assert run_spmd(body, WORLD) == [((2, 3), (2, 3))] * 3 + [((1, 3), (1, 3))]


def test_module_to_a_dtype_after_fully_shard_trains_in_that_dtype():
    """``model.to(torch.float64)`` after fully_shard: shards, gathers and gradients follow, and
    training equals one device's in float64."""
    def body():
        mesh = init_device_mesh("cpu", (WORLD,))
        model = wrap("mlp", build("mlp"), mesh).to(torch.float64)
        assert {p.dtype for p in model.parameters()} == {torch.float64}
        o = torch.optim.Adam(model.parameters(), lr=0.01)
        r, n = mesh.get_local_rank(), BATCH // WORLD
        for s in range(2):
            x, y = batch("mlp", s)
            o.zero_grad()
            loss = loss_fn("mlp", model, x[r * n:(r + 1) * n].double(), y[r * n:(r + 1) * n].double())
            loss.backward()
            o.step()
        return {k: p.full_tensor() for k, p in model.named_parameters()}

    ref = build("mlp").double()
    o = torch.optim.Adam(ref.parameters(), lr=0.01)
    for s in range(2):
        x, y = batch("mlp", s)
        o.zero_grad()
        loss_fn("mlp", ref, x.double(), y.double()).backward()
        o.step()
    for got in run_spmd(body, WORLD):
        for k, p in ref.named_parameters():
            assert got[k].dtype == torch.float64
            torch.testing.assert_close(got[k], p.detach(), rtol=1e-9, atol=1e-9, msg=k)
