"""Partial(max) and Partial(min) through monotone elementwise ops with no communication
(``ORDER_ROWS`` in ``rules/pointwise.py``; torch's ``test_partial_propagation`` counts 0
collectives for these): values equal one device, 1-D and 2-D meshes, in-place forms, and the
cases that must reduce first still right."""
from __future__ import annotations

import pytest
import torch

from shardtensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh, run_spmd
from shardtensor.debug import CommDebugMode

FULL = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)) * 3
OTHER = torch.randn(6, 5, generator=torch.Generator().manual_seed(1)) * 3

UNARY_UP = {
    "relu": torch.relu, "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "atan": torch.atan, "asinh": torch.asinh, "sinh": torch.sinh, "erf": torch.erf,
    "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc, "round": torch.round, "sign": torch.sign,
    "clamp": lambda t: t.clamp(-1.0, 2.0), "clamp_min": lambda t: t.clamp_min(0.5),
    "clamp_max": lambda t: t.clamp_max(0.5), "hardtanh": torch.nn.functional.hardtanh,
    "relu_": lambda t: t.clone().relu_(), "exp_": lambda t: t.clone().exp_(), "tanh_": lambda t: t.clone().tanh_(),
    "clamp_": lambda t: t.clone().clamp_(-1.0, 1.0),
}
WITH_REPLICATE = {  # (op on (partial, replicate)): non-decreasing in the Partial operand
    "maximum": torch.maximum, "minimum": torch.minimum, "fmax": torch.fmax, "fmin": torch.fmin,
    "add": torch.add, "sub": torch.sub, "logaddexp": torch.logaddexp, "clamp_min_t": torch.clamp_min,
    "add_": lambda a, b: a.clone().add_(b),
}


def _run(mesh_shape, placements, fn, other_pl=None):
    def body():
        mesh = init_device_mesh("cpu", mesh_shape)
        x = distribute_tensor(FULL, mesh, placements)
        args = [x] if other_pl is None else [x, distribute_tensor(OTHER if other_pl != "same" else FULL * 0.5, mesh,
                                                                  placements if other_pl == "same" else other_pl)]
        with CommDebugMode() as comm:
            y = fn(*args)
        return comm.get_total_counts(), tuple(y.placements), y.full_tensor()
    return run_spmd(body, 4)[0]


MESHES = [((4,), lambda k: [Partial(k)]), ((2, 2), lambda k: [Shard(0), Partial(k)])]


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("mesh_shape,pl", MESHES, ids=["1d", "2d"])
@pytest.mark.parametrize("name", list(UNARY_UP))
def test_non_decreasing_unary_ops_keep_the_partial(name, mesh_shape, pl, kind):
    fn = UNARY_UP[name]
    comms, out, y = _run(mesh_shape, pl(kind), fn)
    torch.testing.assert_close(y, fn(FULL))
    assert comms == 0 and out == tuple(pl(kind))


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("mesh_shape,pl", MESHES, ids=["1d", "2d"])
@pytest.mark.parametrize("name", list(WITH_REPLICATE))
def test_a_partial_with_a_replicate_operand_keeps_the_partial(name, mesh_shape, pl, kind):
    fn = WITH_REPLICATE[name]
    other = [Replicate()] if len(mesh_shape) == 1 else [Shard(0), Replicate()]
    comms, out, y = _run(mesh_shape, pl(kind), fn, other)
    torch.testing.assert_close(y, fn(FULL, OTHER))
    assert comms == 0 and out == tuple(pl(kind))


@pytest.mark.parametrize("mesh_shape,pl", MESHES, ids=["1d", "2d"])
def test_negation_swaps_max_and_min_and_joins_keep_their_kind(mesh_shape, pl):
    for kind, swapped in (("max", "min"), ("min", "max")):
        for fn in (torch.neg, torch.special.erfc):
            comms, out, y = _run(mesh_shape, pl(kind), fn)
            torch.testing.assert_close(y, fn(FULL))
            assert comms == 0 and out == tuple(pl(swapped))
    for kind, fn in (("max", torch.maximum), ("min", torch.minimum)):
        comms, out, y = _run(mesh_shape, pl(kind), fn, "same")
        torch.testing.assert_close(y, fn(FULL, FULL * 0.5))
        assert comms == 0 and out == tuple(pl(kind))


@pytest.mark.parametrize("mesh_shape,pl", MESHES, ids=["1d", "2d"])
def test_a_join_of_the_other_kind_reduces_one_operand_only(mesh_shape, pl):
    """maximum(P(min), P(min)): reduce one operand; max(., b) is non-decreasing, so the other stays P(min)."""
    for kind, fn in (("min", torch.maximum), ("max", torch.minimum)):
        comms, out, y = _run(mesh_shape, pl(kind), fn, "same")
        torch.testing.assert_close(y, fn(FULL, FULL * 0.5))
        assert comms == 1 and out == tuple(pl(kind))


@pytest.mark.parametrize("name,fn,other", [
    ("replicate minus a partial", lambda a, b: torch.sub(b, a), [Replicate()]),
    ("gelu is not monotone", torch.nn.functional.gelu, None),
    ("log is not defined everywhere", torch.log, None),
    ("neg_ in place cannot swap", lambda t: t.clone().neg_(), None),
], ids=lambda v: v if isinstance(v, str) else "")
def test_what_is_not_monotone_reduces_first_and_stays_right(name, fn, other):
    for kind in ("max", "min"):
        comms, out, y = _run((4,), [Partial(kind)], fn, other)
        want = fn(FULL) if other is None else fn(FULL, FULL * 0.5 if other == "same" else OTHER)
        torch.testing.assert_close(y, want, equal_nan=True)
        assert out != (Partial(kind),)
