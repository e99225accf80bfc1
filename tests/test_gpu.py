"""GPU tests: the simulated world on CUDA, gloo processes sharing one GPU, NCCL at world size 1.

Every test here carries the ``gpu`` marker and is skipped where CUDA is absent (CI has no
GPU).  Run them with ``./scripts/test.sh -m gpu`` on a machine with one.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from test_fsdp import _tp_body, _tp_reference, assert_matches  # noqa: E402

from shardtensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh, run_spmd  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _ops_body():
    mesh = init_device_mesh("cuda", (2, 2))
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(7, 5, generator=g).cuda(), torch.randn(5, 6, generator=g).cuda()
    da = distribute_tensor(a, mesh, [Shard(0), Replicate()])
    db = distribute_tensor(b, mesh, [Replicate(), Shard(1)])
    out = (da @ db).softmax(-1).sum(0)
    total = distribute_tensor(a, mesh, [Shard(1), Shard(0)]).sum()
    assert any(isinstance(p, Partial) for p in total.placements)
    return out.full_tensor().cpu(), total.redistribute(mesh, [Replicate(), Replicate()]).to_local().cpu(), \
        da.to_local().device.type


def test_sim_world_ops_on_cuda():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(7, 5, generator=g), torch.randn(5, 6, generator=g)
    want = (a.cuda() @ b.cuda()).softmax(-1).sum(0).cpu()
    for out, p, dev in run_spmd(_ops_body, 4, timeout=60):
        assert dev == "cuda"
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(p, a.sum())


def test_sim_world_trains_tp_x_fsdp_on_cuda():
    """TP on mesh["tp"], fully_shard on mesh["dp"], Adam, 3 steps on a cuda mesh: the backward's
    reduce-scatter used to wait forever on torch's one CUDA autograd thread."""
    out = run_spmd(_tp_body, 4, 3, "torch", "cuda", timeout=60)
    ref_losses, ref_params = _tp_reference(3, device="cuda")
    assert_matches([(r[0], {n: p.cpu() for n, p in r[1].items()}) for r in out],
                   (ref_losses, {n: p.cpu() for n, p in ref_params.items()}), tol=1e-5)


def test_demo_in_the_simulated_world_on_cuda(capsys):
    from shardtensor.examples.tiny_lm import main

    assert main(steps=3, device="cuda") == 0
    assert "losses match single-device training" in capsys.readouterr().out


def test_torchrun_gloo_processes_share_the_gpu():
    """``torchrun --nproc-per-node 4 -m shardtensor demo --backend gloo --device cuda``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "shardtensor", "demo", "--backend", "gloo", "--device", "cuda", "--steps", "3"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=_env(), cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "losses match single-device training" in res.stdout


_NCCL_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh
    from shardtensor.comm.torchdist import _pending
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    mesh = init_device_mesh("cuda", (1,))
    assert mesh.transport.name == "torch.distributed/nccl", mesh.transport.name
    x = torch.arange(12.0, device="cuda").reshape(3, 4)
    d = distribute_tensor(x, mesh, [Shard(0)])
    assert torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), x)
    p = DTensor.from_local(x, mesh, [Partial()])
    assert torch.equal(p.redistribute(mesh, [Replicate()]).to_local(), x)
    assert torch.equal((d @ d.T).full_tensor(), x @ x.T)
    w = comm.all_reduce(x, "sum", mesh, 0, async_op=True)
    assert torch.equal(w.wait(), x)
    # torch.distributed's own NCCL work behind the transport's async handles, on a side stream
    out = torch.empty(1, 3, 4, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = x * 2
        h = _pending(dist.all_gather_into_tensor(out, y, async_op=True), out, y)
    got = h.wait()
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(got[0], x * 2) and h.is_completed()
    t = x.clone()
    dist.all_reduce(t, dist.ReduceOp.AVG)
    dist.barrier(device_ids=[0])
    assert torch.equal(t, x)
    dist.destroy_process_group()
    print("NCCL OK")
""")


def test_nccl_world_size_one(tmp_path):
    script = tmp_path / "nccl_check.py"
    script.write_text(_NCCL_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "NCCL OK" in res.stdout


# -- the one-launch Triton copy kernels on CUDA, against the CPU kernels ---------------------

_CC_CASES = [  # shapes, dim, chunks, input dtype, output dtype
    ([(5, 3), (7,), (2, 4, 3), (1,)], 0, 4, torch.float32, torch.float32),
    ([(1000, 7), (3,), (513, 2)], 0, 8, torch.bfloat16, torch.float32),
    ([(9, 2), (4,)], 0, 3, torch.bfloat16, torch.bfloat16),
    ([(2, 5, 3), (2, 7), (2, 1, 4)], 1, 2, torch.float32, torch.float32),
    ([(40_000, 3), (40_000, 5)], 1, 2, torch.float32, torch.float32),  # 80,000 rows: two launches
    ([(6, 4), (3,)], 0, 2, torch.int64, torch.int64),
    ([(1001, 4), (64, 4), (4096,)], 0, 8, torch.float32, torch.float32),  # 16-byte accesses (VEC 4)
    ([(1001, 8), (4096,)], 0, 8, torch.bfloat16, torch.float32),  # widening with 16-byte stores
    ([(2048, 16), (512,)], 0, 8, torch.bfloat16, torch.bfloat16),  # VEC 8, 2048-wide blocks
]


@pytest.mark.parametrize("case", range(len(_CC_CASES)))
def test_triton_chunk_cat_on_cuda_matches_the_cpu_kernel(case, monkeypatch):
    from shardtensor.kernels import chunk_cat, gpu

    shapes, dim, k, dt, odt = _CC_CASES[case]
    g = torch.Generator().manual_seed(case)
    cpu = [(torch.randn(s, generator=g) * 50).to(dt) for s in shapes]
    if case % 2:
        cpu.append((torch.randn(shapes[0][::-1], generator=g) * 50).to(dt).transpose(0, -1))  # non-contiguous
    want = chunk_cat(cpu, dim, k, out=torch.empty(0, dtype=odt))
    calls = []
    monkeypatch.setattr(gpu, "chunk_cat", lambda *a, f=gpu.chunk_cat: (calls.append(1), f(*a))[1])
    out = torch.full(want.shape, 7, dtype=odt, device="cuda")
    ins = [t.cuda() for t in cpu]
    for _ in range(2):  # the second call reuses the cached table
        chunk_cat(ins, dim, k, out=out)
        assert torch.equal(out.cpu(), want)
        out.fill_(7)
    assert len(calls) == 2


@pytest.mark.parametrize("r", [2, 4])  # 4: every band a multiple of the 16-byte vector
def test_triton_split_with_sizes_copy_on_cuda_matches_the_cpu_kernel(r):
    from shardtensor.kernels import split_with_sizes_copy

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1000, r, generator=g)
    sizes = [400, 0, 511, 89]
    want = [torch.empty(0) for _ in sizes]
    split_with_sizes_copy(x, sizes, 1, out=want)
    outs = [torch.full_like(w, 9.0, device="cuda") for w in want]
    split_with_sizes_copy(x.cuda(), sizes, 1, out=outs)
    assert all(torch.equal(o.cpu(), w) for o, w in zip(outs, want))


def test_triton_kernels_raise_before_any_write_on_cuda():
    from shardtensor.kernels import chunk_cat

    out = torch.full((2, 7), 3.0, device="cuda")
    with pytest.raises(RuntimeError, match="elements"):
        chunk_cat([torch.ones(5, device="cuda")], 0, 2, out=out)
    assert torch.equal(out, torch.full((2, 7), 3.0, device="cuda"))


def test_fsdp_packs_through_the_triton_kernels_on_cuda(monkeypatch):
    from shardtensor.kernels import gpu

    calls = {"cc": 0, "split": 0}
    cc, sp = gpu.chunk_cat, gpu.split_with_sizes_copy
    monkeypatch.setattr(gpu, "chunk_cat", lambda *a: (calls.__setitem__("cc", calls["cc"] + 1), cc(*a))[1])
    monkeypatch.setattr(gpu, "split_with_sizes_copy",
                        lambda *a: (calls.__setitem__("split", calls["split"] + 1), sp(*a))[1])
    run_spmd(_tp_body, 4, 1, "torch", "cuda", timeout=60)
    assert calls["cc"] > 0 and calls["split"] > 0, calls


def test_torch_compile_with_inductor_on_cuda():
    """Inductor's CUDA kernels around shardtensor's traced collectives: a TP MLP forward and
    backward, and a redistribution inside the graph, equal to eager shardtensor."""
    from test_compile import _tp_mlp, _traced_collectives

    torch._dynamo.reset()
    assert run_spmd(_tp_mlp, 4, "inductor", None, "cuda", timeout=300) == [[True] * 6] * 4
    torch._dynamo.reset()
    for placements, kinds, in_graph, fwd, gx, gy in run_spmd(_traced_collectives, 4, "cuda", timeout=300):
        assert kinds == ["all_to_all", "all_to_all"] and in_graph and fwd and gx and gy


def _new_rules_body():
    """The scatter and lookup rules, 3-D attention and resize_ on a cuda mesh."""
    import torch.nn.functional as F

    mesh = init_device_mesh("cuda", (2, 2))
    g = torch.Generator().manual_seed(5)
    x, src = torch.randn(8, 6, generator=g).cuda(), torch.randn(5, 6, generator=g).cuda()
    idx, places = torch.tensor([0, 3, 3, 7, 1]).cuda(), torch.tensor([0, 5, 9, 7, 1]).cuda()  # places distinct
    w, bags, offs = torch.randn(10, 8, generator=g).cuda(), torch.tensor([1, 2, 3, 9, 0]).cuda(), torch.tensor([0, 3]).cuda()
    q = torch.randn(4, 6, 8, generator=g).cuda()
    seq = torch.linspace(-2, 2, 9).cuda()
    d = lambda t, *pl: distribute_tensor(t, mesh, list(pl) or [Replicate(), Replicate()])  # noqa: E731
    S0, S1, R = Shard(0), Shard(1), Replicate()
    pairs = [
        (d(x, R, S1).index_reduce(0, d(idx), d(src, R, S1), "amax"), x.index_reduce(0, idx, src, "amax")),
        (d(x, S0, S1).put(d(places), d(src[0, :5])), x.put(places, src[0, :5])),
        (d(x, S0, R).masked_scatter(d(x > 0), d(src.flatten().repeat(2))), x.masked_scatter(x > 0, src.flatten().repeat(2))),
        (torch.searchsorted(d(seq), d(x, S0, S1)), torch.searchsorted(seq, x)),
        (F.embedding_bag(d(bags), d(w, R, S1), d(offs), mode="max"), F.embedding_bag(bags, w, offs, mode="max")),
        (F.scaled_dot_product_attention(d(q, S0, R), d(q, S0, R), d(q, S0, R), is_causal=True),
         F.scaled_dot_product_attention(q, q, q, is_causal=True)),
        (d(x, S0, S1).resize_(4, 5), x.clone().resize_(4, 5)),
    ]
    grow = d(x)
    try:
        grow.resize_(20, 20)  # torch cannot grow a CUDA wrapper's storage without allocating it
        refused = ""
    except NotImplementedError as e:
        refused = str(e)
    return [(got.full_tensor().cpu(), want.cpu()) for got, want in pairs], refused, tuple(grow.shape)


def test_scatter_lookup_attention_and_resize_rules_on_cuda():
    for res, refused, shape in run_spmd(_new_rules_body, 4, timeout=120):
        for i, (got, want) in enumerate(res):
            torch.testing.assert_close(got, want, msg=f"case {i}")
        assert "growing a DTensor on cuda" in refused and shape == (8, 6), (refused, shape)
