"""torch's ``register_sharding``: a user's list of acceptable shardings becomes an op's rule
(simulated world, 1-D and 2-D meshes, against one device and torch's DTensor)."""
from __future__ import annotations

import pytest
import torch

from shardtensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh, run_spmd
from shardtensor.debug import CommDebugMode
from shardtensor.experimental import register_sharding
from shardtensor.propagation import RULES, clear_cache

aten = torch.ops.aten

_LIB = torch.library.Library("shardtensor_test", "DEF")  # noqa: TOR901
_LIB.define("rownorm(Tensor x, float eps) -> Tensor")
_LIB.define("scaled(Tensor x, Tensor w) -> (Tensor, Tensor)")


@torch.library.impl(_LIB, "rownorm", "CompositeExplicitAutograd")
def _rownorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / (x.norm(dim=-1, keepdim=True) + eps)


@torch.library.impl(_LIB, "scaled", "CompositeExplicitAutograd")
def _scaled(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * w, (x * w).sum(-1)


@pytest.fixture
def restore_rules():
    ops = [torch.ops.shardtensor_test.rownorm.default, torch.ops.shardtensor_test.scaled.default, aten._softmax.default]
    before = {op: RULES.get(op) for op in ops}
    yield
    for op, rule in before.items():
        if rule is None:
            RULES.pop(op, None)
        else:
            RULES[op] = rule
    clear_cache()


def _rownorm_shardings(x, eps):
    """Any dim but the last may be sharded (as torch's docstring example writes them)."""
    assert isinstance(eps, float) and x.ndim == 3
    return [([Replicate()], [Replicate(), None])] + [([Shard(d)], [Shard(d), None]) for d in range(x.ndim - 1)]


@pytest.mark.parametrize("mesh_shape,placements", [((4,), [Shard(0)]), ((4,), [Shard(2)]), ((4,), [Replicate()]),
                                                   ((2, 2), [Shard(1), Shard(2)]), ((2, 2), [Shard(2), Shard(0)])],
                         ids=str)
def test_a_custom_op_runs_on_the_shardings_its_function_lists(restore_rules, mesh_shape, placements):
    """A custom op with no rule gets one from ``register_sharding``: a listed sharding runs with
    no communication; a sharding on the last dim (not listed) moves to the cheapest listed one;
    equal to one device (uneven sizes)."""
    op = torch.ops.shardtensor_test.rownorm.default
    register_sharding(op)(_rownorm_shardings)
    full = torch.randn(5, 6, 7, generator=torch.Generator().manual_seed(0))
    dense = op(full, 1e-6)

    def body():
        mesh = init_device_mesh("cpu", mesh_shape)
        x = distribute_tensor(full, mesh, placements)
        with CommDebugMode() as comm:
            y = op(x, 1e-6)
        assert all(not isinstance(p, Shard) or p.dim != 2 for p in y.placements)
        return y.full_tensor(), comm.get_total_counts(), y.placements

    for y, comms, out_pl in run_spmd(body, 4):
        torch.testing.assert_close(y, dense)
        if not any(isinstance(p, Shard) and p.dim == 2 for p in placements):
            assert comms == 0 and tuple(out_pl) == tuple(placements)


def test_several_outputs_and_partial_rows(restore_rules):
    """Two outputs (one placement each), and a Partial row: ``x * w`` with x Partial and w
    Replicate stays Partial, its row sum too, with no communication."""
    op = torch.ops.shardtensor_test.scaled.default

    @register_sharding(op)
    def _(x, w):
        return [([Replicate(), Replicate()], [Replicate(), Replicate()]),
                ([Shard(0), Shard(0)], [Shard(0), Replicate()]),
                ([Partial(), Partial()], [Partial(), Replicate()])]

    xf = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    wf = torch.randn(4, generator=torch.Generator().manual_seed(2))
    dense = op(xf, wf)

    def body():
        mesh = init_device_mesh("cpu", (2,))
        out = []
        for pl in ([Shard(0)], [Partial()], [Shard(1)]):
            x = distribute_tensor(xf, mesh, pl)
            w = distribute_tensor(wf, mesh, [Replicate()])
            with CommDebugMode() as comm:
                a, b = op(x, w)
            out.append((a.placements, b.placements, comm.get_total_counts(), a.full_tensor(), b.full_tensor()))
        return out

    for rows in run_spmd(body, 2):
        for (pa, pb, comms, a, b), want in zip(rows, ((Shard(0),), (Partial(),), None)):
            torch.testing.assert_close(a, dense[0])
            torch.testing.assert_close(b, dense[1])
            if want is not None:
                assert tuple(pa) == tuple(pb) == want and comms == 0


def test_it_replaces_an_ops_rule_and_matches_torchs_docstring_example(restore_rules):
    """torch's own example (softmax may shard any dim but the softmax dim) overrides our rule,
    including decisions cached before it; the input is moved as that list allows."""
    full = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))

    def body():
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(full, mesh, [Shard(1)])
        before = torch.softmax(x, 1).placements  # our rule: may move the input anyhow

        @register_sharding(aten._softmax.default)
        def custom_softmax_sharding(x, dim, half_to_float):
            softmax_dim = dim if dim >= 0 else dim + x.ndim
            acceptable = [([Replicate()], [Replicate(), None, None])]
            for d in range(x.ndim):
                if d != softmax_dim:
                    acceptable.append(([Shard(d)], [Shard(d), None, None]))
            return acceptable

        calls = []
        rule = RULES[aten._softmax.default]
        RULES[aten._softmax.default] = lambda call: calls.append(1) or rule(call)
        y = torch.softmax(x, 1)
        return before, y.placements, y.full_tensor(), len(calls)

    for before, after, y, calls in run_spmd(body, 2):
        torch.testing.assert_close(y, torch.softmax(full, 1))
        assert calls == 1 and tuple(after) in ((Shard(0),), (Replicate(),))


def test_a_sharding_list_of_the_wrong_length_names_the_op(restore_rules):
    op = torch.ops.shardtensor_test.rownorm.default
    register_sharding([op])(lambda x, eps: [([Replicate()], [Replicate(), Replicate(), None])])

    def body():
        mesh = init_device_mesh("cpu", (2,))
        with pytest.raises(ValueError, match="rownorm.*2 input placements .not None. for 1 DTensor"):
            op(distribute_tensor(torch.ones(2, 2, 2), mesh, [Shard(0)]), 0.0)
        return True

    assert all(run_spmd(body, 2))
