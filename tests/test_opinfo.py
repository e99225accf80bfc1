"""Every op of torch's OpInfo database with CPU float32 samples, on DTensors, against one device.

One sample per op, its first tensor on ``Shard(0)`` over 4 simulated ranks (OpInfo sizes are
mostly uneven there), forward and backward: the CI-sized draw of ``benchmarks/opinfo_sweep.py``
(whose full table, every layout and two samples, is in benchmarks/README.md).  A wrong value or
a hang fails at once; the pass rate may only go up.
"""
from __future__ import annotations

import pathlib
import sys
import warnings

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import opinfo_sweep  # noqa: E402

MIN_PASS_PERCENT = 98.0
"""The floor this draw met when it was added; raise it as rules land."""


@pytest.mark.timeout(900)
def test_opinfo_first_sample_first_input_sharded():
    failures: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per_side = opinfo_sweep.sweep(opinfo_sweep.float32_ops(), 1, ("first-shard",), {"shardtensor": None},
                                      lambda side, name, lay, outcome, msg: failures.append(f"{outcome} {name}: {msg}"))
    s = opinfo_sweep.summary(per_side["shardtensor"])
    assert s["ops"] >= 500, s  # the database was read (a broken import must not pass as 0 failures)
    bad = [f for f in failures if f.startswith(("wrong", "hang"))]
    assert not bad, "\n".join(bad)
    assert s["pass %"] >= MIN_PASS_PERCENT, (s, "\n".join(failures))


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
