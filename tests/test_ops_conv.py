"""Convolution, pooling and group norm on DTensors: values and gradients against one device,
the placements the rules pick, and no fallback (no gathered input) where a shard can stay."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from opcheck import MESHES, check, data, gen, run_recorded

from shardtensor import Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.errors import ReplicateFallbackWarning

R, S0, S1, PS = Replicate(), Shard(0), Shard(1), Partial("sum")


def _x(shape, seed):
    return data("any", shape, gen(seed))


CONVS = [
    ("conv1d", lambda x, w, b: F.conv1d(x, w, b, padding=1), (5, 3, 9), (7, 3, 3), (7,)),
    ("conv2d", lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), (5, 3, 7, 6), (6, 3, 3, 3), (6,)),
    ("conv3d", lambda x, w, b: F.conv3d(x, w, b), (3, 2, 4, 5, 4), (5, 2, 2, 3, 2), (5,)),
    ("conv_transpose2d", lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), (5, 6, 4, 3), (6, 3, 3, 3), (3,)),
    ("grouped", lambda x, w, b: F.conv2d(x, w, b, groups=2), (5, 4, 6, 6), (6, 2, 3, 3), (6,)),
]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name,fn,xs,ws,bs", CONVS, ids=[c[0] for c in CONVS])
def test_convolution_forward_and_backward(mesh, name, fn, xs, ws, bs):
    # uneven batch (5) and channel counts (3, 7, 6) over 4 ranks: empty pieces included
    x, w, b = _x(xs, (name, "x")), _x(ws, (name, "w")), _x(bs, (name, "b"))
    check(fn, [x, w, b], mesh, limit=10, tol={"rtol": 1e-4, "atol": 1e-4}, grad_tol={"rtol": 1e-3, "atol": 1e-3})


def test_convolution_without_bias():
    x, w = _x((5, 3, 7, 6), "nb-x"), _x((6, 3, 3, 3), "nb-w")
    check(lambda a, k: F.conv2d(a, k, padding=1), [x, w], (4,), limit=10, tol={"rtol": 1e-4, "atol": 1e-4},
          grad_tol={"rtol": 1e-3, "atol": 1e-3})


@pytest.mark.parametrize("combo,out", [
    ((S0, R, R), S0),   # batch
    ((R, S0, S0), S1),  # out channels
    ((S1, S1, R), PS),  # in channels: the replicated bias is partitioned, the output partial
    ((PS, R, R), PS),   # a partial input stays partial (convolution is linear in it)
])
def test_convolution_keeps_the_cheap_layouts(combo, out):
    x, w, b = _x((8, 4, 6, 6), "k-x"), _x((8, 4, 3, 3), "k-w"), _x((8,), "k-b")
    seen = check(lambda a, k, c: F.conv2d(a, k, c), [x, w, b], (4,), combos=[tuple((p,) for p in combo)], grad=False)
    assert seen[0][1] == (out,)


def _gathers(mesh, fn, shape, placements):
    """Bytes gathered when running ``fn`` on a ``placements`` tensor (fallback or all-gather)."""
    def body(m):
        x = distribute_tensor(_x(shape, "g"), m, placements)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReplicateFallbackWarning)
            y = fn(x)
        return tuple(y.placements)
    out, events = run_recorded(mesh, body)
    return out[0], [e.kind for e in events if e.kind != "broadcast"]  # distribute_tensor broadcasts


POOLS = [
    ("max_pool1d", lambda a: F.max_pool1d(a, 2), (5, 3, 9)),
    ("max_pool2d", lambda a: F.max_pool2d(a, 3, stride=2, padding=1), (5, 3, 7, 6)),
    ("max_pool3d", lambda a: F.max_pool3d(a, 2), (3, 5, 4, 5, 4)),
    ("avg_pool1d", lambda a: F.avg_pool1d(a, 3), (5, 3, 9)),
    ("avg_pool2d", lambda a: F.avg_pool2d(a, 2, ceil_mode=True), (5, 3, 7, 6)),
    ("avg_pool3d", lambda a: F.avg_pool3d(a, 2), (3, 5, 4, 5, 4)),
    ("adaptive_avg_pool2d", lambda a: F.adaptive_avg_pool2d(a, (3, 2)), (5, 3, 7, 6)),
    ("adaptive_avg_pool3d", lambda a: F.adaptive_avg_pool3d(a, 2), (3, 5, 4, 5, 4)),
    ("adaptive_max_pool1d", lambda a: F.adaptive_max_pool1d(a, 4), (5, 3, 9)),
    ("adaptive_max_pool2d", lambda a: F.adaptive_max_pool2d(a, (3, 2)), (5, 3, 7, 6)),
    ("unbatched_max_pool2d", lambda a: F.max_pool2d(a, 2), (3, 7, 6)),
]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name,fn,shape", POOLS, ids=[p[0] for p in POOLS])
def test_pooling_forward_and_backward(mesh, name, fn, shape):
    check(fn, [_x(shape, name)], mesh, limit=8, partial=("sum",))


@pytest.mark.parametrize("name,fn,shape", [p for p in POOLS if p[0] in ("max_pool2d", "avg_pool2d",
                                                                         "adaptive_max_pool2d")],
                         ids=["max_pool2d", "avg_pool2d", "adaptive_max_pool2d"])
def test_pooling_keeps_batch_and_channel_shards_without_communication(name, fn, shape):
    for pl in ([S0], [S1]):
        out, kinds = _gathers((4,), fn, shape, pl)
        assert out == tuple(pl) and kinds == [], (pl, out, kinds)


@pytest.mark.parametrize("mesh", MESHES)
def test_group_norm_forward_and_backward(mesh):
    x, w, b = _x((5, 6, 4, 3), "gn-x"), _x((6,), "gn-w"), _x((6,), "gn-b")
    seen = check(lambda a, k, c: F.group_norm(a, 3, k, c), [x, w, b], mesh, limit=8,
                 tol={"rtol": 1e-4, "atol": 1e-4}, grad_tol={"rtol": 1e-3, "atol": 1e-3})
    for (xp, _, _), out in seen:
        assert out == tuple(p if p == S0 else R for p in xp)


def test_batch_sharded_conv_net_trains_without_gathering_activations():
    # conv -> relu -> max_pool -> group_norm on a batch-sharded input: the only collectives of
    # forward and backward are the weight gradients' reductions (no activation is gathered)
    def body(m):
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        norm = torch.nn.GroupNorm(2, 4)
        x = distribute_tensor(_x((8, 3, 6, 6), "net"), m, [S0])
        from shardtensor import DTensor
        params = {n: torch.nn.Parameter(distribute_tensor(p.detach(), m, [R]))
                  for n, p in [("w", conv.weight), ("b", conv.bias), ("gw", norm.weight), ("gb", norm.bias)]}
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReplicateFallbackWarning)
            y = F.conv2d(x, params["w"], params["b"], padding=1).relu()
            y = F.group_norm(F.max_pool2d(y, 2), 2, params["gw"], params["gb"])
            loss = y.sum()
            loss.backward()
        assert isinstance(y, DTensor) and tuple(y.placements) == (S0,)
        return [tuple(params[k].grad.placements) for k in ("w", "b", "gw", "gb")]
    out, events = run_recorded((4,), body)
    assert all(p in ((PS,), (R,)) for p in out[0]), out[0]
    assert {e.kind for e in events} <= {"all_reduce", "broadcast"}, [e.kind for e in events]  # broadcast: distribute


@pytest.mark.parametrize("pool", [
    lambda a: F.max_pool2d(a, 2),
    lambda a: F.adaptive_max_pool2d(a, 3, return_indices=True)[0],
    lambda a: F.max_pool3d(a.unsqueeze(2), (1, 2, 2)).squeeze(2),
], ids=["max_pool2d", "adaptive_max_pool2d", "max_pool3d"])
def test_max_pool_of_a_partial_reduce_scatters_into_a_plane_dim(pool):
    """A max pool reduces a Partial input first: a reduce-scatter into the channels (each plane is
    pooled alone), half the bytes of the all-reduce; the value equals one device."""
    x = _x((2, 4, 6, 6), "pool-p")

    def body(m):
        from shardtensor import DTensor
        dx = DTensor.from_local(x / 4, m, [PS])
        with comm.scope("op"):
            y = pool(dx)
        return tuple(y.placements), y.full_tensor()
    out, events = run_recorded((4,), body)
    assert sorted({e.kind for e in events if "op" in e.scope}) == ["reduce_scatter"]
    for pl, full in out:
        assert pl == (S1,)
        torch.testing.assert_close(full, pool(x))


@pytest.mark.parametrize("mesh", MESHES)
def test_max_pool_partial_inputs_and_grads(mesh):
    check(lambda a: F.max_pool2d(a, 2), [_x((2, 4, 6, 6), "pool-pg")], mesh, limit=8)
    check(lambda a: F.adaptive_max_pool1d(a, 2), [_x((3, 4, 4), "pool-1d")], mesh, limit=8)
