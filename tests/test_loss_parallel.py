"""``shardtensor.parallel.loss_parallel``: cross-entropy on class-sharded logits equals dense
cross-entropy, forward and backward, and moves only per-row statistics."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardtensor import CommTrace, DTensor, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh, run_spmd
from shardtensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

CASES = [  # mesh shape, logits placements, logits shape
    ((4,), [Shard(1)], (6, 11)),
    ((4,), [Shard(1)], (5, 3)),          # one rank holds no class
    ((2, 2), [Shard(0), Shard(1)], (7, 9)),
    ((2, 2), [Shard(1), Shard(1)], (4, 10)),
    ((4,), [Shard(1)], (3, 7, 5)),       # (N, C, d)
    ((4,), [Shard(0)], (10,)),           # one row of classes, 0-d target
    ((2, 2), [Partial(), Shard(1)], (4, 6)),
]
OPTIONS = [dict(), dict(reduction="sum"), dict(reduction="none"), dict(ignore_index=2),
           dict(label_smoothing=0.1), dict(weight=True, ignore_index=0, label_smoothing=0.2),
           dict(weight=True, reduction="none")]


def _data(shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    c = shape[1] if len(shape) > 1 else shape[0]
    tshape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    t = torch.randint(0, c, tshape, generator=g)
    w = torch.rand(c, generator=g) + 0.5
    return x, t, w


def _body(mesh_shape, pl, shape, opts, dtype):
    x, t, w = _data(shape, dtype)
    mesh = init_device_mesh("cpu", mesh_shape)
    kw = dict(opts)
    if kw.pop("weight", False):
        kw["weight"] = w
    xd = distribute_tensor(x, mesh, pl).requires_grad_()
    with loss_parallel(), comm.recording() as log:
        loss = F.cross_entropy(xd, t, **kw)
        fwd = [(e.kind, e.shape) for e in log.of_rank(mesh.get_rank())]
        del log.events[:]
        full = loss.full_tensor()
        (full * torch.arange(1, full.numel() + 1).reshape(full.shape).to(dtype)).sum().backward() \
            if full.ndim else full.backward()
        bwd = [e.kind for e in log.of_rank(mesh.get_rank()) if e.scope == ()]
    return full.detach(), xd.grad.full_tensor(), fwd, bwd


COMBOS = [(m, p, s, o) for m, p, s in CASES for o in OPTIONS
          if not (len(s) == 1 and o.get("reduction") == "none")]  # a 1-D input has one row


@pytest.mark.parametrize("mesh_shape,pl,shape,opts", COMBOS, ids=[f"{m}-{s}-{o}" for m, _, s, o in COMBOS])
def test_equals_dense_forward_and_backward(mesh_shape, pl, shape, opts):
    x, t, w = _data(shape)
    kw = dict(opts)
    if kw.pop("weight", False):
        kw["weight"] = w
    xr = x.clone().requires_grad_()
    want = F.cross_entropy(xr, t, **kw)
    (want * torch.arange(1, want.numel() + 1).reshape(want.shape).float()).sum().backward() \
        if want.ndim else want.backward()
    world = 4
    for loss, grad, fwd, _ in run_spmd(_body, world, mesh_shape, pl, shape, opts, torch.float32):
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, xr.grad, rtol=1e-5, atol=1e-5)
        assert "all_gather" not in {k for k, _ in fwd}, fwd  # the logits are never gathered


def test_communication_is_per_row_statistics():
    """Forward: one max and one sum all-reduce of per-row values over the class dim; backward:
    nothing for the logits (the batch dim's Partial loss is reduced before backward starts)."""
    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        x, t, _ = _data((8, 64))
        xd = distribute_tensor(x, mesh, [Shard(0), Shard(1)]).requires_grad_()
        with loss_parallel(), CommTrace(modules=False) as trace:
            loss = F.cross_entropy(xd, t, label_smoothing=0.1)
            loss = loss.full_tensor()
            n_fwd = len(trace.of_rank(mesh.get_rank()))
            loss.backward()
        events = trace.of_rank(mesh.get_rank())
        return [(e.kind, e.mesh_dim, e.shape) for e in events], n_fwd

    events, n_fwd = run_spmd(body, 4)[0]
    stats = [e for e in events[:n_fwd] if e[1] == 1]
    assert stats == [("all_reduce", 1, (4, 1)), ("all_reduce", 1, (3, 4))], events  # rows x (max), (3 stats, rows)
    assert all(k != "all_gather" for k, _, _ in events)
    assert all(shape == () or k == "all_reduce" and shape[-1] <= 4 for k, _, shape in events), events
    assert len(events) - n_fwd <= 1, events[n_fwd:]  # backward: at most the scalar loss's Replicate->Partial


def test_bf16_logits_keep_their_dtype():
    x, t, _ = _data((6, 12), torch.bfloat16)
    want = F.cross_entropy(x.float(), t)
    for loss, grad, _, _ in run_spmd(_body, 4, (4,), [Shard(1)], (6, 12), {}, torch.bfloat16):
        assert loss.dtype == torch.bfloat16 and grad.dtype == torch.bfloat16
        torch.testing.assert_close(loss.float(), want, rtol=2e-2, atol=2e-2)


def test_vocab_parallel_head_trains_as_one_device():
    """A ColwiseParallel head with use_local_output=False feeds loss_parallel, as in torch's recipe."""
    torch.manual_seed(0)
    head = nn.Linear(8, 13)
    x = torch.randn(6, 8)
    t = torch.randint(0, 13, (6,))
    F.cross_entropy(head(x), t).backward()
    want = head.weight.grad.clone()

    def body():
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        m = nn.Linear(8, 13)
        parallelize_module(m, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
        with loss_parallel():
            logits = m(x)
            loss = F.cross_entropy(logits, t)
            loss.backward()
        return logits.placements, m.weight.grad.full_tensor()

    for pl, grad in run_spmd(body, 4):
        assert pl == (Shard(1),)
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)


def test_other_calls_run_as_usual():
    """Probability targets and replicated logits take the ordinary path inside the context."""
    def body():
        mesh = init_device_mesh("cpu", (4,))
        x, t, _ = _data((5, 6))
        p = torch.softmax(torch.randn(5, 6, generator=torch.Generator().manual_seed(1)), -1)
        with loss_parallel():
            a = F.cross_entropy(distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(p, mesh, [Shard(1)])).full_tensor()
            b = F.cross_entropy(distribute_tensor(x, mesh, [Replicate()]), t).full_tensor()
            c = F.cross_entropy(x, t)
        return a, b, c

    x, t, _ = _data((5, 6))
    p = torch.softmax(torch.randn(5, 6, generator=torch.Generator().manual_seed(1)), -1)
    for a, b, c in run_spmd(body, 4):
        torch.testing.assert_close(a, F.cross_entropy(x, p))
        torch.testing.assert_close(b, F.cross_entropy(x, t))
        assert not isinstance(c, DTensor)
        torch.testing.assert_close(c, F.cross_entropy(x, t))
