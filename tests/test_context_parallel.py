"""Context parallelism: ring attention, its layouts, the DTensor path and torch's entry points.

Oracle: dense single-device ``F.scaled_dot_product_attention`` (forward and backward, random
upstream gradients); a packed sequence's oracle is the same call with the block-diagonal causal
mask.  The case functions are top-level so the gloo run (tests/test_gloo.py) runs them too.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from shardtensor import Partial, Replicate, Shard
from shardtensor.cp import contiguous, head_tail, per_document, ring_attention
from shardtensor.cp.api import context_parallel, context_parallel_unshard, default_layout, set_rotate_method
from shardtensor.cp.dtensor import sequence_attention

TOL = dict(rtol=1e-5, atol=1e-5)
LAYOUTS = {"contiguous": contiguous, "head_tail": head_tail}


def _qkvd(length, gqa=False, dtype=torch.float32, seed=0, batch=2, dv=10):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, d = 4, (2 if gqa else 4), 8
    shapes = [(batch, heads, length, d), (batch, kv_heads, length, d), (batch, kv_heads, length, dv),
              (batch, heads, length, dv)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def dense_attention(q, k, v, dout, causal, gqa, documents=None):
    """One device: the output and the three gradients."""
    mask = None
    if documents is not None:
        mask = documents[:, None] == documents[None, :]
        if causal:
            mask &= torch.ones(mask.shape, dtype=torch.bool).tril()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=causal and mask is None,
                                         enable_gqa=gqa)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def case_ring(mesh, layout, causal, gqa, method="ring", dtype=torch.float32, seed=0, dv=10):
    """Ring attention on this rank's plain pieces equals the dense pieces (forward, backward);
    ``dv=8`` (value head dim = query's) lets full and causal blocks use torch's fused kernel."""
    q, k, v, dout = _qkvd(layout.length, gqa, dtype, seed, dv=dv)
    want = dense_attention(q, k, v, dout, causal, gqa, layout.documents)
    idx = layout.positions[mesh.get_local_rank(0) if mesh.ndim == 1 else 0]
    mine = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, mesh=mesh, mesh_dim=0, layout=layout, is_causal=causal, enable_gqa=gqa, method=method)
    out.backward(dout[:, :, idx])
    tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, ref in zip([out.detach()] + [t.grad for t in mine], want):
        assert got.dtype == dtype
        torch.testing.assert_close(got, ref[:, :, idx], **tol)


def case_dtensor(mesh, placements, causal, gqa, length=11):
    """SDPA on DTensors with the sequence sharded: output sharded like the queries, equal to dense."""
    q, k, v, dout = _qkvd(length, gqa, seed=4, batch=3)
    want = dense_attention(q, k, v, dout, causal, gqa)
    leaves = [st.distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa)
    seq = [j for j, p in enumerate(placements) if p.is_shard(2)]
    assert [j for j, p in enumerate(out.placements) if p.is_shard(2)] == seq, out.placements
    out.backward(st.distribute_tensor(dout, mesh, out.placements))
    for got, ref in zip([out] + [t.grad for t in leaves], want):
        torch.testing.assert_close(got.full_tensor(), ref, **TOL)


def spmd(fn, ranks, *args):
    return st.run_spmd(lambda: fn(*args), ranks)


def mesh_of(shape):
    return st.init_device_mesh("cpu", shape)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("length", [16, 13], ids=["even", "uneven"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("gqa,dv", [(False, 8), (False, 10), (True, 8)], ids=["fused-kernel", "math", "gqa"])
def test_ring_equals_one_device(ranks, length, layout, causal, gqa, dv):
    lay = LAYOUTS[layout](length, ranks)
    spmd(lambda: case_ring(mesh_of((ranks,)), lay, causal, gqa, dv=dv), ranks)


@pytest.mark.parametrize("method", ["ring", "gather"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_packed_documents_and_gather(method, ranks):
    """Attention stays inside each document (one shorter than the ranks); both rotate methods."""
    lay = per_document([5, 17, 3, 9], ranks)
    for causal, gqa in ((True, True), (False, True), (True, False)):
        spmd(lambda: case_ring(mesh_of((ranks,)), lay, causal, gqa, method, dv=8), ranks)


def test_low_precision_and_more_ranks_than_positions():
    """bfloat16 within its rounding (scores kept in float32); a rank without positions."""
    spmd(lambda: case_ring(mesh_of((4,)), head_tail(16, 4), True, False, dtype=torch.bfloat16), 4)
    spmd(lambda: case_ring(mesh_of((2,)), head_tail(13, 2), True, False, dtype=torch.float64, dv=8), 2)
    spmd(lambda: case_ring(mesh_of((4,)), contiguous(3, 4), True, True), 4)


DTENSOR_CASES = [((4,), (Shard(2),)), ((2,), (Shard(2),)), ((2, 2), (Shard(0), Shard(2))),
                 ((2, 2), (Shard(2), Shard(1))), ((2, 2), (Partial(), Shard(2))),
                 ((2, 2, 2), (Shard(0), Shard(2), Shard(1))), ((2, 2, 2), (Replicate(), Shard(2), Shard(1))),
                 ((2, 2), (Shard(2), Shard(2))), ((2, 2, 2), (Shard(2), Shard(0), Shard(2)))]


@pytest.mark.parametrize("mesh_shape,placements", DTENSOR_CASES, ids=str)
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_sequence_sharded_dtensor_runs_the_ring(mesh_shape, placements, gqa):
    spmd(lambda: case_dtensor(mesh_of(mesh_shape), list(placements), True, gqa), math.prod(mesh_shape))


def _received(fn, ranks):
    with st.CommTrace() as trace:
        st.run_spmd(fn, ranks)
    return {r: sum(e.bytes_received for e in trace.of_rank(r)) for r in trace.ranks()}


@pytest.mark.parametrize("method", ["ring", "gather", "heads"])
def test_forward_bytes_are_the_analytic_minimum(method):
    """Ring and gather: each rank receives every other rank's keys and values once; heads (the
    all-to-all mode): (P-1)/P of its q, k, v in and of the output back."""
    ranks, length = 4, (16 if method == "heads" else 13)
    q, k, v, _ = _qkvd(length, dv=8)  # one head dim: torch's fused kernel (its math path moves more)

    def fn():
        mesh = mesh_of((ranks,))
        qkv = [st.distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v)]
        with st.CommTrace() as trace:
            F.scaled_dot_product_attention(*qkv, is_causal=True)
        return sum(e.bytes_received for e in trace.of_rank(mesh.get_rank()))

    sequence_attention(method)
    try:
        got = st.run_spmd(fn, ranks)
    finally:
        sequence_attention("ring")
    counts = [c.numel() for c in torch.arange(length).chunk(ranks)]
    per_pos = 4 * 2 * (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3])  # float32 x batch x (k + v)
    if method == "heads":  # (P-1)/P of this rank's q, k, v and output blocks
        assert got == [3 * 2 * 4 * (q.shape[3] + k.shape[3] + 2 * v.shape[3]) * 4] * ranks, got
        return
    assert got == [(length - n) * per_pos for n in counts], got


@pytest.mark.parametrize("length,ranks", [(1000, 4), (997, 4), (64, 2), (255, 8)])
def test_head_tail_balances_causal_work_for_any_length(length, ranks):
    work = head_tail(length, ranks).work(causal=True)
    mean = sum(work) / len(work)
    assert max(abs(w - mean) for w in work) <= 0.1 * mean, work
    plain = contiguous(length, ranks).work(causal=True)
    assert max(plain) > 1.5 * min(plain)  # what balancing is for


def test_per_document_balances_uneven_documents():
    lay = per_document([100, 377, 23, 500, 61], 4)
    work = lay.work(causal=True)
    mean = sum(work) / len(work)
    assert max(abs(w - mean) for w in work) <= 0.1 * mean, work
    assert sorted(torch.cat(lay.positions).tolist()) == list(range(1061))


def test_layouts_match_torch_order_when_it_divides():
    lay = default_layout(8, 2)
    assert [p.tolist() for p in lay.positions] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert default_layout(7, 2).kind == "contiguous" and default_layout(7, 2, "head_tail").kind == "head_tail"
    with pytest.raises(ValueError, match="load_balance"):
        default_layout(8, 2, "zigzag")
    with pytest.raises(ValueError, match="document_lengths"):
        default_layout(8, 2, document_lengths=[3, 3])


class TinyLM(torch.nn.Module):
    """Embedding, one causal attention block with GQA, and a head: a torch-style model."""

    def __init__(self):
        super().__init__()
        self.emb, self.q, self.kv = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.o, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 50)

    def forward(self, x):
        h = self.emb(x)
        b, n, _ = h.shape
        q = self.q(h).view(b, n, 4, 4).transpose(1, 2)
        k, v = self.kv(h).view(b, n, 2, 2, 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.head(h + self.o(a.transpose(1, 2).reshape(b, n, 16)))


def train_tiny(cp_mesh, length, steps=3, rotate="alltoall"):
    """Losses of a few SGD steps; under ``cp_mesh`` each step runs inside ``context_parallel``."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x, y = (torch.randint(0, 50, (2, length), generator=g) for _ in range(2))
        if cp_mesh is None:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        else:
            set_rotate_method(rotate)
            with context_parallel(cp_mesh, buffers=[x, y], buffer_seq_dims=[1, 1]):
                assert x.shape[1] < length
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") / (2 * length)
                loss.backward()
            assert x.shape[1] == length  # restored
            for p in model.parameters():
                p.grad = st.comm.all_reduce(p.grad, "sum", cp_mesh, 0)
            loss = st.comm.all_reduce(loss.detach(), "sum", cp_mesh, 0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("length", [16, 13], ids=["head-tail", "uneven"])
@pytest.mark.parametrize("rotate", ["alltoall", "allgather"])
def test_torch_style_context_parallel_training_equals_one_device(length, rotate):
    want = train_tiny(None, length)
    try:
        got = st.run_spmd(lambda: train_tiny(mesh_of((4,)), length, rotate=rotate), 4)
    finally:
        set_rotate_method("alltoall")
    for losses in got:
        assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_unshard_round_trip_and_clear_errors():
    def fn():
        mesh = mesh_of((4,))
        x = torch.arange(2 * 13 * 3.0).view(2, 13, 3)
        full = x.clone()
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1], load_balance="head_tail"):
            whole, = context_parallel_unshard(mesh, [x], [1])
            assert torch.equal(whole, full)
            q = torch.randn(1, 2, x.shape[1], 4)
            with pytest.raises(NotImplementedError, match="attn_mask"):
                F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(13, 13, dtype=torch.bool))
            with pytest.raises(ValueError, match="holds"):
                F.scaled_dot_product_attention(q[:, :, :1], q, q)
        with pytest.raises(ValueError, match="buffer_seq_dims"):
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[]):
                pass
        with pytest.raises(ValueError, match="subset"):
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1], no_restore_buffers={full}):
                pass
        with pytest.raises(NotImplementedError, match="rotate_method"):
            set_rotate_method("ring")
        assert torch.equal(x, full)

    st.run_spmd(fn, 4)


def test_drop_in_names_point_at_ours():
    import shardtensor.dropin as dropin

    dropin.install()
    try:
        import torch.distributed.tensor.experimental as exp
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard as unshard

        assert exp.context_parallel is context_parallel and unshard is context_parallel_unshard
    finally:
        dropin.uninstall()


def test_torchtitans_form_pieces_wrapped_as_dtensors_read_the_declared_order():
    """torchtitan's path: ``_context_parallel_shard`` with torch's head-tail load balancer, the
    pieces wrapped as sequence-sharded DTensors, the dispatcher switched on; equal to one device."""
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    from shardtensor.cp.api import context_parallel_shard, disable_dispatcher, enable_dispatcher

    q, k, v, dout = _qkvd(16, gqa=True)
    want = dense_attention(q, k, v, dout, True, True)

    def fn():
        mesh = mesh_of((4,))
        pieces = context_parallel_shard(mesh, [q, k, v, dout], [2] * 4, _HeadTailLoadBalancer(16, 4, "cpu"))
        leaves = [p.clone().requires_grad_() for p in pieces[:3]]
        out = F.scaled_dot_product_attention(*(st.DTensor.from_local(t, mesh, [Shard(2)]) for t in leaves),
                                             is_causal=True, enable_gqa=True)
        out.to_local().backward(pieces[3])
        mine = head_tail(16, 4).positions[mesh.get_rank()]
        for got, ref in zip([out.to_local().detach()] + [t.grad for t in leaves], want):
            torch.testing.assert_close(got, ref[:, :, mine], **TOL)

    enable_dispatcher()
    try:
        st.run_spmd(fn, 4)
    finally:
        disable_dispatcher()


@pytest.mark.parametrize("dv,used", [(8, True), (10, False)])
def test_full_and_causal_blocks_use_torchs_fused_kernel_where_it_applies(monkeypatch, dv, used):
    import shardtensor.cp.blocks as blocks

    calls = []
    fused = blocks._FLASH
    monkeypatch.setattr(blocks, "_FLASH", lambda *a, **k: calls.append(1) or fused(*a, **k))
    spmd(lambda: case_ring(mesh_of((2,)), head_tail(16, 2), True, False, dv=dv), 2)
    assert bool(calls) == used


HYBRID = [((2, 2), (Shard(2), Shard(2)), False), ((2, 2), (Shard(2), Shard(2)), True),
          ((2, 2, 2), (Shard(2), Shard(2), Shard(1)), False), ((2, 2, 2), (Shard(0), Shard(2), Shard(2)), True)]


@pytest.mark.parametrize("mesh_shape,placements,gqa", HYBRID, ids=str)
def test_hybrid_heads_on_one_mesh_dim_ring_on_the_other(mesh_shape, placements, gqa):
    """The sequence on two mesh dims: all-to-all to heads on the outer one, a ring on the inner
    one (with tensor parallelism sharding heads on a third); equal to one device."""
    sequence_attention("hybrid")
    try:
        spmd(lambda: case_dtensor(mesh_of(mesh_shape), list(placements), True, gqa, length=16), math.prod(mesh_shape))
    finally:
        sequence_attention("ring")


def test_hybrid_moves_an_all_to_all_and_a_ring():
    """(2, 2) mesh, 16 positions, 4 heads: q, k, v to heads on mesh dim 0 ((P-1)/P of each rank's
    4-position block of 4 heads), keys and values once round the 2-rank ring of dim 1 (8 positions
    of 2 heads), the output back to the sequence."""
    q, k, v, _ = _qkvd(16, dv=8)

    def fn():
        mesh = mesh_of((2, 2))
        qkv = [st.distribute_tensor(t, mesh, [Shard(2), Shard(2)]) for t in (q, k, v)]
        with st.CommTrace() as trace:
            F.scaled_dot_product_attention(*qkv, is_causal=True)
        return sum(e.bytes_received for e in trace.of_rank(mesh.get_rank()))

    sequence_attention("hybrid")
    try:
        got = st.run_spmd(fn, 4)
    finally:
        sequence_attention("ring")
    block = 2 * 4 * 4 * 8 * 4  # batch x heads x positions x dim x float32: one rank's q (or k, v, out)
    assert got == [4 * block // 2 + 2 * block] * 4, got


def test_set_rotate_method_applies_to_sequence_sharded_dtensors_too():
    """One setting, as in torch: its dispatcher path (torchtitan's) follows set_rotate_method."""
    from shardtensor.cp.dtensor import rotate_method

    set_rotate_method("allgather")
    try:
        assert rotate_method() == "gather"
    finally:
        set_rotate_method("alltoall")
    assert rotate_method() == "ring"
