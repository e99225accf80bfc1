"""Every op of torch's OpInfo database with CPU float32 samples, on DTensors, against one device.

The CI-sized slice of ``benchmarks/opinfo_sweep.py``: per op the one sample that covers the most
kinds of input (square, non-square, batched, evenly and unevenly split), each of its inputs in
turn sharded on each of its dims on 4 ranks, each floating input ``Partial``, and each on a 2-D
mesh with two shard dims and with a shard and a Partial; forward and backward with a random
upstream gradient, every input's gradient compared; random ops checked by property.  A wrong
value, a crash where one device runs, or a hang fails at once (the full table, four samples
and every layout, is in benchmarks/README.md).
"""
from __future__ import annotations

import warnings

import pytest

import opinfo_sweep

@pytest.mark.timeout(1200)
@pytest.mark.main_release
def test_opinfo_every_input_sharded_on_every_dim_partial_2d_and_packed():
    failures: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per_side = opinfo_sweep.sweep(opinfo_sweep.float32_ops(), 1, ("shard", "partial", "2d", "strided"),
                                      {"shardtensor": None},
                                      lambda side, name, lay, outcome, msg: failures.append(f"{outcome} {name} {lay}: {msg}"))
    s = opinfo_sweep.summary(per_side["shardtensor"])
    assert s["ops"] >= 500 and s["cases"] >= 3000, s  # the database was read (a broken import must not pass)
    assert s["cases even"] and s["cases uneven"] and s["cases random"], s
    bad = [f for f in failures if f.startswith(("wrong", "hang"))]
    assert not bad, "\n".join(bad)
    assert not failures, "\n".join(failures)  # crashes and refusals where one device runs


def test_sweep_harness_sees_a_wrong_value():
    """The harness must flag a DTensor result that differs from dense torch as ``wrong``."""
    import torch

    from shardtensor import DTensor

    def off_by_rank(x):
        if isinstance(x, DTensor):
            return x + 1.0  # differs from dense on purpose
        return x

    out, _ = opinfo_sweep.classify(off_by_rank, [torch.ones(5, 3)], (4,), ((opinfo_sweep.R,),), grad=False)
    assert out == "wrong"


def test_sweep_runs_pytorch_dtensor_side_by_side():
    """The reference side (PyTorch's DTensor on threads) runs a case and classifies it."""
    import torch
    import torch_world

    out, msg = opinfo_sweep.classify(lambda a, b: a * b, [torch.ones(5, 3), torch.ones(5, 3)], (4,),
                                     ((opinfo_sweep.Shard(0),), (opinfo_sweep.R,)), grad=True,
                                     runner=torch_world.runner)
    assert out == "pass", msg


def test_sweep_checks_random_ops_by_property():
    """A random op is compared by property: a dropout scaled wrongly on DTensors is ``wrong``; the
    right one passes."""
    import torch
    import torch.nn.functional as F

    from shardtensor import DTensor

    def scaled(k):
        def fn(x):
            out = F.dropout(x, 0.5, training=True)
            return out * k if isinstance(x, DTensor) else out
        return fn

    x = [torch.randn(16, 12)]
    for k, want in ((1.0, "pass"), (3.0, "wrong")):
        random = opinfo_sweep._comparable(scaled(k), x)
        assert isinstance(random, opinfo_sweep.Random)
        out, msg = opinfo_sweep.classify(scaled(k), x, (4,), ((opinfo_sweep.Shard(0),),), grad=True, random=random)
        assert out == want, (k, msg)
