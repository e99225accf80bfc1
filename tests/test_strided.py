"""StridedShard: the packed layout of fused weights (torch's ``_StridedShard``), against torch's own
split of the pieces and against dense single-device torch, forward and backward."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardtensor import (DTensor, Partial, Replicate, Shard, StridedShard, distribute_tensor, implicit_replication,
                         init_device_mesh, run_spmd)
from shardtensor.comm import recording


def _torch_pieces(x: torch.Tensor, dim: int, sf: int, k: int) -> list[torch.Tensor]:
    """torch's own pieces of ``_StridedShard(dim, sf)`` over ``k`` ranks (the reference)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=sf)._split_tensor(x, k, with_padding=False)[0]


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("length", [0, 1, 5, 8, 13])
@pytest.mark.parametrize("sf", [2, 3])
def test_pieces_are_torchs_and_every_redistribution_round_trips(k, length, sf):
    x = torch.arange(length * 3, dtype=torch.float64).reshape(length, 3)
    want = _torch_pieces(x, 0, sf, k)

    def rank():
        mesh = init_device_mesh("cpu", (k,))
        d = distribute_tensor(x, mesh, [StridedShard(0, sf)])
        seen = [torch.equal(d.to_local(), want[mesh.get_rank()]), torch.equal(d.full_tensor(), x)]
        for target in ([Shard(0)], [Shard(1)], [Replicate()]):
            e = d.redistribute(mesh, target)
            seen += [torch.equal(e.full_tensor(), x), torch.equal(e.redistribute(mesh, d.placements).to_local(),
                                                                   d.to_local())]
        return seen

    for seen in run_spmd(rank, k):
        assert all(seen), seen


@pytest.mark.parametrize("placements", [[Shard(0), StridedShard(0, 2)], [StridedShard(1, 2), Shard(0)],
                                        [Partial(), StridedShard(0, 3)], [StridedShard(0, 2), StridedShard(1, 2)]])
@pytest.mark.parametrize("shape", [(12, 6), (7, 5)])
def test_two_dim_meshes_round_trip(placements, shape):
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def rank():
        mesh = init_device_mesh("cpu", (2, 2))
        d = distribute_tensor(x, mesh, placements)
        seen = [torch.allclose(d.full_tensor(), x)]
        for target in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), StridedShard(0, 2)]):
            e = d.redistribute(mesh, target)
            seen.append(torch.allclose(e.full_tensor(), x))
            if not any(p.is_partial() for p in placements):
                seen.append(torch.equal(e.redistribute(mesh, placements).to_local(), d.to_local()))
        return seen

    for seen in run_spmd(rank, 4):
        assert all(seen), seen


def test_from_local_infers_the_global_shape_and_checks_the_pieces():
    x, y = torch.randn(10, 4), torch.randn(12, 4)  # uneven pieces (6 and 4 rows), even ones

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        local = distribute_tensor(x, mesh, [StridedShard(0, 2)]).to_local()
        inferred = DTensor.from_local(local, mesh, [StridedShard(0, 2)])
        even = distribute_tensor(y, mesh, [StridedShard(0, 2)]).to_local()
        assumed = DTensor.from_local(even, mesh, [StridedShard(0, 2)], run_check=False)  # no comm: even pieces
        with pytest.raises(ValueError, match="local shapes disagree"):
            DTensor.from_local(local[: 1 + mesh.get_rank()], mesh, [StridedShard(0, 2)])
        return inferred.shape, assumed.shape, torch.equal(inferred.full_tensor(), x)

    for got in run_spmd(rank, 2):
        assert got == (torch.Size([10, 4]), torch.Size([12, 4]), True)


def test_bad_placements_name_what_to_write_instead():
    def rank():
        mesh = init_device_mesh("cpu", (2, 2))
        with pytest.raises(NotImplementedError, match="shard_order"):
            distribute_tensor(torch.ones(8, 2), mesh, [StridedShard(0, 2), Shard(0)])
        with pytest.raises(NotImplementedError, match="two StridedShard"):
            distribute_tensor(torch.ones(8, 2), mesh, [StridedShard(0, 2), StridedShard(0, 2)])
        with pytest.raises(ValueError, match="split_factor"):
            StridedShard(0, 0)
        with pytest.raises(TypeError, match="not both"):
            StridedShard(0, 2, sf=2)
        one = distribute_tensor(torch.ones(8, 2), mesh, [StridedShard(-1, 1), StridedShard(-2, sf=2)])
        return one.placements

    for pl in run_spmd(rank, 4):
        assert pl == (Shard(1), StridedShard(0, 2))


def test_elementwise_ops_and_foreach_keep_the_layout_and_move_nothing():
    x, y = torch.randn(8, 3), torch.randn(8, 3)

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        a, b = (distribute_tensor(t, mesh, [StridedShard(0, 2)]) for t in (x, y))
        s = distribute_tensor(torch.tensor(2.0), mesh, [Replicate()])
        with recording() as log:
            c = ((a * b).abs() + 1).sqrt_() * s
            z = torch.zeros_like(a, dtype=torch.float64)
            lst = torch._foreach_add([a, b], [b, a])
            torch._foreach_mul_(lst, 3.0)
        same = [t.placements == (StridedShard(0, 2),) for t in (c, z, *lst)]
        return (len(log.of_rank(mesh.get_rank())), same, c.full_tensor(), z.dtype, [t.full_tensor() for t in lst])

    for n, same, c, zdtype, lst in run_spmd(rank, 2):
        assert n == 0 and all(same) and zdtype == torch.float64
        torch.testing.assert_close(c, ((x * y).abs() + 1).sqrt() * 2)
        torch.testing.assert_close(lst[0], (x + y) * 3)


def test_other_ops_run_gathered_and_writes_go_back_packed():
    x = torch.randn(8, 6, dtype=torch.float64)

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        a = distribute_tensor(x, mesh, [StridedShard(0, 2)])
        out = [a.sum(0).full_tensor(), (a @ a.T).full_tensor(), a.cumsum(0).full_tensor(), a[3].full_tensor()]
        with implicit_replication():  # not elementwise: computed gathered, written back packed
            a.index_fill_(0, torch.tensor([1, 6]), -1.0)
        a.copy_(a * 2)
        b = distribute_tensor(x, mesh, [StridedShard(0, 2)])
        b.copy_(distribute_tensor(x + 1, mesh, [Replicate()]))  # another layout: gathered, written back
        return out, a.placements, a.full_tensor(), b.placements, b.full_tensor()

    want = x.clone().index_fill_(0, torch.tensor([1, 6]), -1.0) * 2
    for out, apl, a, bpl, b in run_spmd(rank, 2):
        for got, ref in zip(out, [x.sum(0), x @ x.T, x.cumsum(0), x[3]]):
            torch.testing.assert_close(got, ref)
        assert apl == bpl == (StridedShard(0, 2),)
        torch.testing.assert_close(a, want)
        torch.testing.assert_close(b, x + 1)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_a_packed_gate_up_weight_trains_as_on_one_device(mesh_shape):
    """A fused gate/up expert weight (E, 2I, H) packed over the last mesh dim: forward through
    its local pieces' layout, backward, gradient clipping and AdamW equal dense torch."""
    g = torch.Generator().manual_seed(0)
    w0, x0 = torch.randn(3, 8, 5, dtype=torch.float64, generator=g), torch.randn(4, 5, dtype=torch.float64, generator=g)

    def step_losses(w, x, opt):
        losses = []
        for _ in range(3):
            gate, up = F.linear(x, w[1]).chunk(2, -1)
            loss = (F.silu(gate) * up).pow(2).sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_([w], 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())
        return losses

    w = w0.clone().requires_grad_()
    ref = step_losses(w, x0, torch.optim.AdamW([w], lr=0.1)), w.detach()
    pl = [Replicate()] * (len(mesh_shape) - 1) + [StridedShard(1, 2)]

    def rank():
        mesh = init_device_mesh("cpu", mesh_shape)
        w = torch.nn.Parameter(distribute_tensor(w0, mesh, pl))
        opt = torch.optim.AdamW([w], lr=0.1)
        losses = step_losses(w, distribute_tensor(x0, mesh, [Replicate()] * len(mesh_shape)), opt)
        return losses, w.full_tensor(), w.placements, opt.state[w]["exp_avg"].placements

    for losses, w, wpl, spl in run_spmd(rank, math.prod(mesh_shape)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]))
        torch.testing.assert_close(w, ref[1])
        assert wpl == spl == tuple(pl)


def test_distribute_a_meta_tensor_builds_metadata_only():
    def rank():
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(torch.empty(3, 16, 8, device="meta"), mesh, [StridedShard(1, 2)], src_data_rank=None)
        return d.to_local().shape, d.to_local().device.type, d.shape

    for local, dev, shape in run_spmd(rank, 4):
        assert local == torch.Size([3, 4, 8]) and dev == "meta" and shape == torch.Size([3, 16, 8])


class _Experts(torch.nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.gate_up = torch.nn.Parameter(w.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up[1]).chunk(2, -1)
        return F.silu(gate) * up


def test_fully_shard_over_a_packed_tensor_parallel_weight_trains_as_on_one_device():
    """FSDP on dp over a (E, 2I, H) weight packed on dim 1 over tp (torch's FSDP x TP with a
    fused weight); a weight packed on dim 0, which FSDP also shards, is refused by name."""
    from shardtensor import fully_shard

    g = torch.Generator().manual_seed(0)
    w0, x0 = torch.randn(3, 8, 5, dtype=torch.float64, generator=g), torch.randn(4, 5, dtype=torch.float64, generator=g)

    def train(model, x):
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            loss = model(x).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())
        return losses

    ref_model = _Experts(w0)
    ref = train(ref_model, x0), ref_model.gate_up.detach()

    def rank():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _Experts(w0)
        model.gate_up = torch.nn.Parameter(distribute_tensor(w0, mesh["tp"], [StridedShard(1, 2)]))
        fully_shard(model, mesh=mesh["dp"])
        losses = train(model, distribute_tensor(x0, mesh["tp"], [Replicate()]))
        bad = _Experts(w0)
        bad.gate_up = torch.nn.Parameter(distribute_tensor(w0, mesh["tp"], [StridedShard(0, 2)]))
        with pytest.raises(NotImplementedError, match="gate_up.*packed on dim 0"):
            fully_shard(bad, mesh=mesh["dp"])
        return losses, model.gate_up.full_tensor(), model.gate_up.placements

    for losses, w, pl in run_spmd(rank, 4):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]))
        torch.testing.assert_close(w, ref[1])
        assert pl == (Shard(0), StridedShard(1, 2))


def test_a_drawing_shows_each_block_of_a_packed_tensor():
    from shardtensor.debug.visualize import pieces

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        d = distribute_tensor(torch.zeros(8, 4), mesh, [StridedShard(0, 2)])
        return [(p.rank, p.shape, p.offset) for p in pieces(d)]

    assert run_spmd(rank, 2)[0] == [(0, (2, 4), (0, 0)), (0, (2, 4), (4, 0)), (1, (2, 4), (2, 0)), (1, (2, 4), (6, 0))]


def test_shardtensor_plan_spells_it_and_prints_the_block_exchange(capsys):
    from shardtensor.cli import main

    assert main(["plan", "--mesh", "2,2", "--shape", "12,6", "--src", "SS(0,2),P", "--dst", "S1,R"]) == 0
    assert main(["plan", "--mesh", "4", "--shape", "8", "--src", "StridedShard(dim=0,sf=2)", "--dst", "R"]) == 0
    text = capsys.readouterr().out
    assert "(SS(0,2), P(sum))" in text and "(SS(0,2))" in text
    assert "total 96 B on the wire (= the lower bound" in text  # 8 floats, each rank lacks 6 of them
