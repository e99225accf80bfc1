"""Tensor parallelism (shardtensor.parallel): plans written as for torch's TP API, trained on
4 simulated ranks and compared step by step with single-device training of the same model.

Covers Colwise/Rowwise on Linear and Embedding, SequenceParallel on LayerNorm,
PrepareModuleInput/Output, uneven shards (hidden 14 and sequence 7 over 4 ranks), a 1-D
mesh and the "tp" dim of a (2, 2) mesh, SGD and Adam, the collectives of an MLP step, and
one real 4-process gloo run that also runs the same plan code through
``torch.distributed.tensor.parallel`` for comparison.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


import shardtensor
from shardtensor import DTensor, Replicate, Shard, comm, init_device_mesh, run_spmd
from shardtensor import parallel as st_parallel
from shardtensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, SequenceParallel,
                                  distribute_module, parallelize_module)

try:
    from distributed import gloo_available, run_multiprocess
except ImportError:  # tests/ imported as a package
    from tests.distributed import gloo_available, run_multiprocess

STEPS = 5
TOL = dict(atol=2e-5, rtol=1e-5)


# -- models (written for one device) ---------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16, act: str = "gelu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU() if act == "gelu" else nn.ReLU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        o = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 16, n_heads: int = 4, hidden: int = 16, n_layers: int = 1) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, n_heads, hidden) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# -- plans, written exactly as for torch.distributed.tensor.parallel ------------------------
# ``P`` is the parallel module (shardtensor.parallel or torch.distributed.tensor.parallel) and
# ``L`` the placements' module (shardtensor or torch.distributed.tensor): only the import differs.

def mlp_plan(P, L) -> dict:
    return {"fc1": P.ColwiseParallel(), "fc2": P.RowwiseParallel()}


def sp_plan(P, L, local: bool = True) -> dict:
    """Megatron-style TP with sequence parallelism (torchtitan's plan); ``local=False`` keeps
    every activation a DTensor and computes the loss on vocab-sharded logits."""
    u = {} if local else {"use_local_output": False}
    return {
        "tok_embeddings": P.RowwiseParallel(input_layouts=L.Replicate(), output_layouts=L.Shard(1), **u),
        "norm": P.SequenceParallel(),
        "output": (P.ColwiseParallel(input_layouts=L.Shard(1), output_layouts=L.Replicate()) if local
                   else P.ColwiseParallel(input_layouts=L.Shard(1), use_local_output=False)),
        "layers.*.attention_norm": P.SequenceParallel(),
        "layers.*.attention": P.PrepareModuleInput(input_layouts=(L.Shard(1),), desired_input_layouts=(L.Replicate(),)),
        "layers.*.attention.wq": P.ColwiseParallel(**u),
        "layers.*.attention.wk": P.ColwiseParallel(**u),
        "layers.*.attention.wv": P.ColwiseParallel(**u),
        "layers.*.attention.wo": P.RowwiseParallel(output_layouts=L.Shard(1), **u),
        "layers.*.ffn_norm": P.SequenceParallel(),
        "layers.*.feed_forward": P.PrepareModuleInput(input_layouts=(L.Shard(1),),
                                                      desired_input_layouts=(L.Replicate(),)),
        "layers.*.feed_forward.w1": P.ColwiseParallel(**u),
        "layers.*.feed_forward.w2": P.RowwiseParallel(output_layouts=L.Shard(1), **u),
    }


def tp_plan(P, L) -> dict:
    """Plain Megatron TP: replicated activations between blocks, norms left local."""
    return {
        "tok_embeddings": P.ColwiseParallel(output_layouts=L.Replicate()),
        "output": P.ColwiseParallel(output_layouts=L.Replicate()),
        "layers.*.attention.w[qkv]": P.ColwiseParallel(),
        "layers.*.attention.wo": P.RowwiseParallel(),
        "layers.*.feed_forward.w1": P.ColwiseParallel(),
        "layers.*.feed_forward.w2": P.RowwiseParallel(),
    }


PLANS = {
    "mlp": lambda: mlp_plan(st_parallel, shardtensor),
    "sp": lambda: sp_plan(st_parallel, shardtensor),
    "sp_dtensor": lambda: sp_plan(st_parallel, shardtensor, local=False),
    "tp": lambda: tp_plan(st_parallel, shardtensor),
}


# -- training ---------------------------------------------------------------------------------

def make_optimizer(name: str, params, foreach: bool | None = None) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach)
    return torch.optim.Adam(params, lr=0.01, foreach=foreach)


def loss_fn(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    out = model(x)
    if isinstance(model, MLP):
        return F.mse_loss(out, y)
    if isinstance(out, DTensor):  # loss on sharded logits: targets become a replicated DTensor
        y = DTensor.from_local(y, out.device_mesh, [Replicate()])
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def train(model: nn.Module, batch: tuple, opt_name: str, steps: int = STEPS, foreach: bool | None = None) -> list[float]:
    opt = make_optimizer(opt_name, model.parameters(), foreach)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def make_case(kind: str, hidden: int, seq: int = 8, seed: int = 0) -> tuple[nn.Module, tuple]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "mlp":
        return MLP(8, hidden), (torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g))
    model = Transformer(vocab=16, dim=16, n_heads=4, hidden=hidden)
    return model, (torch.randint(0, 16, (2, seq), generator=g), torch.randint(0, 16, (2, seq), generator=g))


def tp_train(model: nn.Module, batch: tuple, plan: dict, opt_name: str, mesh_shape: tuple,
             steps: int = STEPS, foreach: bool | None = None) -> tuple[list[float], dict, dict]:
    """One rank: parallelize a copy of ``model`` and train it; losses, full params, placements."""
    if len(mesh_shape) == 1:
        tp_mesh = init_device_mesh("cpu", mesh_shape)
    else:
        tp_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))["tp"]
    m = parallelize_module(copy.deepcopy(model), tp_mesh, plan)
    placements = {n: tuple(p.placements) for n, p in m.named_parameters() if isinstance(p, DTensor)}
    losses = train(m, batch, opt_name, steps, foreach)
    return losses, full_params(m), placements


def reference(model: nn.Module, batch: tuple, opt_name: str, steps: int = STEPS) -> tuple[list[float], dict]:
    m = copy.deepcopy(model)
    return train(m, batch, opt_name, steps), full_params(m)


def assert_matches(results: list, ref_losses: list[float], ref_params: dict) -> None:
    for rank, (losses, params, _) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL,
                                   msg=lambda m: f"rank {rank} losses {losses} vs {ref_losses}: {m}")
        assert params.keys() == ref_params.keys()
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], **TOL, msg=lambda m: f"rank {rank} param {n}: {m}")


# -- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@pytest.mark.parametrize("hidden", [16, 14])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_mlp_training(mesh_shape, hidden, opt_name):
    model, batch = make_case("mlp", hidden)
    ref_losses, ref_params = reference(model, batch, opt_name)
    results = run_spmd(tp_train, 4, model, batch, PLANS["mlp"](), opt_name, mesh_shape)
    assert_matches(results, ref_losses, ref_params)
    assert results[0][2] == {"fc1.weight": (Shard(0),), "fc1.bias": (Shard(0),), "fc2.weight": (Shard(1),),
                             "fc2.bias": (Replicate(),)}


TRANSFORMER_CASES = [  # plan, mesh, ffn hidden, sequence length, optimizer, foreach
    ("sp", (4,), 14, 7, "adam", None),
    ("sp", (2, 2), 14, 7, "adam", True),
    ("sp_dtensor", (4,), 16, 8, "adam", True),
    ("sp_dtensor", (4,), 14, 7, "sgd", None),
    ("tp", (4,), 16, 8, "sgd", None),
    ("tp", (4,), 14, 7, "adam", None),
    ("tp", (2, 2), 16, 8, "adam", None),
    ("sp", (4,), 16, 8, "sgd", None),
]


@pytest.mark.parametrize("plan,mesh_shape,hidden,seq,opt_name,foreach", TRANSFORMER_CASES)
def test_transformer_training(plan, mesh_shape, hidden, seq, opt_name, foreach):
    model, batch = make_case("transformer", hidden, seq)
    ref_losses, ref_params = reference(model, batch, opt_name)
    results = run_spmd(tp_train, 4, model, batch, PLANS[plan](), opt_name, mesh_shape, STEPS, foreach)
    assert_matches(results, ref_losses, ref_params)
    pl = results[0][2]
    if plan.startswith("sp"):
        assert pl["tok_embeddings.weight"] == (Shard(0),)
        assert pl["layers.0.attention_norm.weight"] == (Replicate(),)
    else:
        assert pl["tok_embeddings.weight"] == (Shard(1),)
        assert "layers.0.attention_norm.weight" not in pl
    assert pl["layers.0.attention.wq.weight"] == (Shard(0),)
    assert pl["layers.0.attention.wo.weight"] == (Shard(1),)
    assert pl["layers.0.feed_forward.w2.bias"] == (Replicate(),)


def _mlp_step_comm(batch: tuple, model: nn.Module):
    mesh = init_device_mesh("cpu", (4,))
    m = parallelize_module(copy.deepcopy(model), mesh, mlp_plan(st_parallel, shardtensor))
    x, y = batch
    comm.barrier(mesh)
    with comm.CommLog(rank=mesh.get_rank()) as fwd:
        out = m(x)
    assert type(out) is torch.Tensor
    loss = F.mse_loss(out, y)
    with comm.CommLog(rank=mesh.get_rank()) as bwd:
        loss.backward()
    return [e.kind for e in fwd.events], [e.kind for e in bwd.events], [type(p.grad).__name__ for p in m.parameters()]


@pytest.mark.parametrize("hidden", [16, 14])
def test_mlp_communication(hidden):
    """Megatron MLP: one all-reduce in forward (the Rowwise Partial output), none in backward;
    uneven shards need no extra size exchange (Linear knows its in_features)."""
    model, batch = make_case("mlp", hidden)
    for fwd, bwd, grads in run_spmd(_mlp_step_comm, 4, batch, model):
        assert fwd == ["all_reduce"]
        assert bwd == []
        assert grads == ["DTensor"] * 4


def _sp_input_sizes(seq: int):
    mesh = init_device_mesh("cpu", (4,))
    norm = parallelize_module(nn.LayerNorm(4), mesh, SequenceParallel())
    r = mesh.get_local_rank()
    n = [2, 2, 2, 1][r] if seq == 7 else 2
    x = torch.randn(2, n, 4)
    out = norm(x)
    return type(out).__name__, tuple(out.shape), tuple(out.placements), tuple(out.to_local().shape)


def test_sequence_parallel_uneven_plain_input():
    """A plain tensor fed to SequenceParallel is this rank's sequence shard; uneven lengths
    (7 over 4 ranks) give the right global shape."""
    res = run_spmd(_sp_input_sizes, 4, 7)
    assert [r[1] for r in res] == [(2, 7, 4)] * 4
    assert {r[2] for r in res} == {(Shard(1),)}
    assert [r[3][1] for r in res] == [2, 2, 2, 1]
    assert {r[0] for r in res} == {"DTensor"}


def _prepare_module_io():
    mesh = init_device_mesh("cpu", (4,))
    r = mesh.get_local_rank()

    class Two(nn.Module):
        def forward(self, a, b, *, c=None):
            return a, b, c

    m = Two()
    parallelize_module(m, mesh, {"": PrepareModuleInput(input_layouts=(Shard(0), None),
                                                        desired_input_layouts=(Replicate(), None),
                                                        input_kwarg_layouts={"c": Replicate()},
                                                        desired_input_kwarg_layouts={"c": Shard(1)})})
    m2 = nn.Identity()
    parallelize_module(m2, mesh, PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate()))
    a = torch.full((1 if r < 3 else 0, 3), float(r))  # 3 rows over 4 ranks: 1, 1, 1, 0
    oa, ob, oc = m(a, torch.ones(2), c=torch.arange(16.).view(2, 8))
    full = m2(torch.full((2, 2), float(r)))
    return (type(oa).__name__, tuple(oa.placements), oa.to_local().tolist(), type(ob).__name__,
            tuple(oc.placements), oc.to_local().tolist(), type(full).__name__, full.tolist())


def test_prepare_module_input_output():
    for r, res in enumerate(run_spmd(_prepare_module_io, 4)):
        assert res[0] == "DTensor" and res[1] == (Replicate(),)
        assert res[2] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]
        assert res[3] == "Tensor"
        assert res[4] == (Shard(1),) and res[5] == [[2. * r, 2. * r + 1], [8 + 2. * r, 9 + 2. * r]]
        assert res[6] == "Tensor"
        assert res[7] == [[float(k)] * 2 for k in range(4) for _ in range(2)]


def _distribute_module_case():
    mesh = init_device_mesh("cpu", (4,))
    seen = []

    def input_fn(mod, inputs, device_mesh):
        seen.append("in")
        return tuple(DTensor.from_local(t, device_mesh, [Replicate()]) for t in inputs)

    def output_fn(mod, out, device_mesh):
        seen.append("out")
        return out.to_local()

    lin = nn.Linear(3, 2)
    lin.register_buffer("stat", torch.zeros(2))
    distribute_module(lin, mesh, None, input_fn, output_fn)
    kinds = {n: (type(p).__name__, isinstance(p, nn.Parameter), tuple(p.placements)) for n, p in lin.named_parameters()}
    out = lin(torch.ones(4, 3))
    try:
        distribute_module(lin, mesh)
        again = None
    except RuntimeError as e:
        again = str(e)
    return kinds, isinstance(lin.stat, DTensor), type(out).__name__, seen, again


def test_distribute_module():
    kinds, buf, out, seen, again = run_spmd(_distribute_module_case, 4)[0]
    assert kinds == {"weight": ("DTensor", True, (Replicate(),)), "bias": ("DTensor", True, (Replicate(),))}
    assert buf and out == "Tensor" and seen == ["in", "out"]
    assert again and "already" in again
    assert shardtensor.distribute_module is distribute_module


def _errors():
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    msgs = []
    for fn in (lambda: parallelize_module(MLP(), mesh2, mlp_plan(st_parallel, shardtensor)),
               lambda: parallelize_module(nn.LayerNorm(4), mesh2["tp"], ColwiseParallel()),
               lambda: parallelize_module(MLP(), mesh2["tp"], {"fc1": "colwise"})):
        try:
            fn()
            msgs.append(None)
        except (ValueError, TypeError, NotImplementedError) as e:
            msgs.append(type(e).__name__ + ": " + str(e))
    return msgs


def test_errors():
    msgs = run_spmd(_errors, 4)[0]
    assert msgs[0].startswith("ValueError") and "mesh['tp']" in msgs[0]
    assert msgs[1].startswith("NotImplementedError") and "LayerNorm" in msgs[1]
    assert msgs[2].startswith("TypeError")
    one = init_device_mesh("cpu", (1,))  # a world of one rank, outside run_spmd
    with pytest.warns(UserWarning, match="'nope'"):
        parallelize_module(MLP(), one, {"nope": ColwiseParallel(), "fc*": ColwiseParallel()})
    with pytest.warns(UserWarning, match="no parallelize_plan"):
        parallelize_module(MLP(), one)


def _src_data_rank(src):
    mesh = init_device_mesh("cpu", (4,))
    r = mesh.get_local_rank()
    lin = nn.Linear(2, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(8.).view(4, 2) + 100 * r)
    parallelize_module(lin, mesh, ColwiseParallel(), src_data_rank=src)
    return lin.weight.to_local().tolist()


def test_src_data_rank():
    """Default: rank 0's values are scattered; None: every rank keeps its own slice."""
    for r, w in enumerate(run_spmd(_src_data_rank, 4, 0)):
        assert w == [[2. * r, 2. * r + 1]]
    for r, w in enumerate(run_spmd(_src_data_rank, 4, None)):
        assert w == [[2. * r + 100 * r, 2. * r + 1 + 100 * r]]


def test_styles_mirror_torch_defaults():
    tp = pytest.importorskip("torch.distributed.tensor.parallel")

    def norm(x):
        return repr(x).replace("dim=", "")

    for name in ("ColwiseParallel", "RowwiseParallel"):
        ours, theirs = getattr(st_parallel, name)(), getattr(tp, name)()
        assert norm(ours.input_layouts) == norm(theirs.input_layouts)
        assert norm(ours.output_layouts) == norm(theirs.output_layouts)
        assert ours.use_local_output is theirs.use_local_output is True
    assert SequenceParallel().sequence_sharding == (Shard(1),)
    assert tp.SequenceParallel().use_local_output is SequenceParallel().use_local_output is False


# -- real processes -----------------------------------------------------------------------------

def _gloo_worker(rank: int, world_size: int, cases: list) -> list:
    """Each case on shardtensor over gloo and, where asked (even shapes: torch's from_local assumes even
    shards), the same plan code on torch's TP."""
    import torch.distributed.tensor as tdt
    import torch.distributed.tensor.parallel as ttp
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    torch.set_num_threads(1)
    out = []
    for kind, plan_name, hidden, seq, opt_name, with_torch in cases:
        model, batch = make_case(kind, hidden, seq)
        plan_fn = mlp_plan if kind == "mlp" else {"sp": sp_plan, "tp": tp_plan}[plan_name]
        foreach = True if plan_name == "sp" else None
        ours = tp_train(model, batch, plan_fn(st_parallel, shardtensor), opt_name, (4,), 3, foreach)
        theirs = None
        if with_torch:
            m = ttp.parallelize_module(copy.deepcopy(model), torch_mesh("cpu", (4,)), plan_fn(ttp, tdt))
            theirs = (train(m, batch, opt_name, 3, foreach), full_params(m))
        out.append((ours[0], ours[1], theirs))
    return out


@pytest.mark.skipif(not gloo_available(), reason="torch.distributed with gloo is not available")
def test_gloo_and_torch_tp():
    cases = [("transformer", "sp", 14, 7, "adam", False), ("transformer", "sp", 16, 8, "adam", True)]
    results = run_multiprocess(_gloo_worker, world_size=4, timeout=240, args=(cases,))
    for i, (kind, _, hidden, seq, opt_name, with_torch) in enumerate(cases):
        model, batch = make_case(kind, hidden, seq)
        ref_losses, ref_params = reference(model, batch, opt_name, steps=3)
        assert_matches([(r[i][0], r[i][1], None) for r in results], ref_losses, ref_params)
        if with_torch:
            assert_matches([(r[i][2][0], r[i][2][1], None) for r in results], ref_losses, ref_params)
