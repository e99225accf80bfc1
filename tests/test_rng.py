"""Random numbers: sharded draws equal one device's, every rank's generator stays in step, and
each simulated rank has its own default generator (``shardtensor.rng``, the factories)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardtensor as st
from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh, run_spmd

try:
    from opcheck import local_piece
except ImportError:  # tests/ imported as a package
    from tests.opcheck import local_piece

LAYOUTS = [((4,), [Shard(0)]), ((4,), [Shard(1)]), ((4,), [Replicate()]), ((2, 2), [Shard(0), Shard(1)]),
           ((2, 2), [Replicate(), Shard(0)]), ((2, 2), [Shard(1), Shard(1)])]

FILLS = {
    "normal_": lambda t: nn.init.normal_(t, 1.0, 2.0),
    "uniform_": lambda t: nn.init.uniform_(t, -3, 3),
    "kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t, a=5 ** 0.5),
    "xavier_normal_": lambda t: nn.init.xavier_normal_(t),
    "trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.02),
    "exponential_": lambda t: t.exponential_(),
    "random_": lambda t: t.random_(0, 100),
    "randn_like": torch.randn_like,
    "rand_like": torch.rand_like,
    "randint_like": lambda t: torch.randint_like(t, 3, 9),
}


def _dense(name, shape, dtype):
    torch.manual_seed(7)
    out = FILLS[name](torch.zeros(shape, dtype=dtype))
    return out, torch.rand(4)


@pytest.mark.parametrize("name", list(FILLS))
@pytest.mark.parametrize("shape,dtype", [((7, 5), torch.float32), ((3, 6), torch.bfloat16), ((5, 3), torch.float64)])
def test_sharded_draw_equals_one_device_and_generators_stay_in_step(name, shape, dtype):
    """With seed s the sharded value is the dense one, sliced (uneven, empty shards included),
    and the next plain ``torch.rand`` agrees with one device's on every rank."""
    want, after = _dense(name, shape, dtype)

    def body(mesh_shape, pl):
        mesh = init_device_mesh("cpu", mesh_shape)
        torch.manual_seed(7)
        x = distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, pl)
        y = FILLS[name](x)
        return y.placements, y.to_local().clone(), torch.rand(4), mesh.get_coordinate()

    for mesh_shape, pl in LAYOUTS:
        for placements, local, later, coord in run_spmd(body, 4, mesh_shape, pl):
            assert placements == tuple(pl)
            assert torch.equal(local, local_piece(want, mesh_shape, coord, pl)), (name, mesh_shape, pl)
            assert torch.equal(later, after), (name, mesh_shape, pl)


def test_factories_equal_one_device():
    torch.manual_seed(3)
    want = [torch.randn(5, 7), torch.rand(3, 2, dtype=torch.float64), torch.rand(2)]

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        torch.manual_seed(3)
        a = st.randn(5, 7, device_mesh=mesh, placements=[Shard(0), Shard(1)])
        b = st.rand((3, 2), device_mesh=mesh, placements=[Shard(0), Replicate()], dtype=torch.float64)
        c = st.full((4,), 2.5, device_mesh=mesh, placements=[Partial(), Shard(0)])
        d = st.ones(3, device_mesh=mesh, placements=[Partial("max"), Replicate()], requires_grad=True)
        with mesh:
            e = st.zeros([2, 3], dtype=torch.int8)
        f = st.empty(0, 4, device_mesh=mesh, placements=[Shard(0), Shard(1)])
        later = torch.rand(2)
        return (a.full_tensor(), b.full_tensor(), later, c.placements, c.full_tensor(), d.full_tensor(),
                d.requires_grad, d.is_leaf, e.placements, e.full_tensor(), tuple(f.shape))

    for a, b, later, c_pl, c, d, grad, leaf, e_pl, e, f in run_spmd(body, 4):
        assert torch.equal(a, want[0]) and torch.equal(b, want[1]) and torch.equal(later, want[2])
        assert c_pl == (Partial("sum"), Shard(0)) and torch.equal(c, torch.full((4,), 2.5))
        assert torch.equal(d.detach(), torch.ones(3)) and grad and leaf
        assert e_pl == (Replicate(), Replicate()) and e.dtype == torch.int8 and not e.any()
        assert f == (0, 4)


def test_factories_reject_bad_arguments():
    def body():
        mesh = init_device_mesh("cpu", (4,))
        with pytest.raises(ValueError, match="size"):
            st.zeros(2, -1, device_mesh=mesh)
        with pytest.raises(ValueError, match="layout"):
            st.ones(2, layout=torch.sparse_coo, device_mesh=mesh)
        with pytest.raises(ValueError, match="device_mesh"):
            st.randn(3)
        return True

    assert all(run_spmd(body, 4))


def test_each_simulated_rank_has_its_own_generator():
    """As processes would: copies of the caller's generator, seeded per rank on request; the
    caller's own generator does not move."""
    torch.manual_seed(11)
    want_model = nn.Linear(4, 3).weight.detach()
    torch.manual_seed(11)
    before = torch.get_rng_state()

    def body(rank_seeded):
        rank = comm.current_transport().rank
        if rank_seeded:
            torch.manual_seed(100 + rank)
        w = nn.Linear(4, 3).weight.detach()
        mask = F.dropout(torch.ones(64), 0.5)
        state = torch.get_rng_state()
        with torch.random.fork_rng():
            torch.rand(5)
        assert torch.equal(torch.get_rng_state(), state)
        return w, mask, torch.initial_seed()

    same = run_spmd(body, 4, False)
    assert all(torch.equal(w, want_model) for w, _, _ in same)
    assert all(torch.equal(m, same[0][1]) for _, m, _ in same)
    assert torch.equal(torch.get_rng_state(), before)
    per_rank = run_spmd(body, 4, True)
    assert [s for _, _, s in per_rank] == [100, 101, 102, 103]
    torch.manual_seed(102)
    assert torch.equal(per_rank[2][0], nn.Linear(4, 3).weight.detach())
    assert not torch.equal(per_rank[0][1], per_rank[1][1])


def test_ranks_with_different_generators_still_agree_and_keep_their_streams():
    """Replicas take coordinate 0's draw; each rank's own stream moves on by the same draw."""
    def body():
        rank = comm.current_transport().rank
        mesh = init_device_mesh("cpu", (2, 2))
        torch.manual_seed(rank)
        x = distribute_tensor(torch.zeros(6, 5), mesh, [Replicate(), Shard(1)])
        x.normal_()
        return x.full_tensor(), torch.rand(3)

    res = run_spmd(body, 4)
    torch.manual_seed(0)
    want = torch.zeros(6, 5).normal_()
    for rank, (full, later) in enumerate(res):
        assert torch.equal(full, want)
        torch.manual_seed(rank)
        torch.zeros(6, 5).normal_()
        assert torch.equal(later, torch.rand(3))


def test_explicit_generator_shared_by_simulated_ranks():
    """One ``torch.Generator`` object used by every simulated rank advances once per draw, as
    one process's would."""
    g = torch.Generator().manual_seed(5)

    def body():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.zeros(9, 2), mesh, [Shard(0)])
        x.uniform_(generator=g)
        y = torch.randn_like(x)
        return x.full_tensor(), y.full_tensor()

    res = run_spmd(body, 4)
    ref = torch.Generator().manual_seed(5)
    want = torch.zeros(9, 2).uniform_(generator=ref)
    assert all(torch.equal(x, want) for x, _ in res)
    assert all(torch.equal(y, res[0][1]) for _, y in res)
    assert torch.equal(g.get_state(), ref.get_state())


def test_dropout_masks_agree_on_replicas_differ_on_shards_and_keep_step():
    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        torch.manual_seed(0)
        x = distribute_tensor(torch.ones(8, 64), mesh, [Shard(0), Replicate()])
        y = F.dropout(x, 0.5)
        z = F.dropout(distribute_tensor(torch.ones(8, 64), mesh, [Replicate(), Replicate()]), 0.5)
        return y.to_local().clone(), z.to_local().clone(), y.full_tensor(), torch.rand(3)

    res = run_spmd(body, 4)
    for local, rep, full, later in res:
        assert torch.equal(rep, res[0][1])
        assert torch.equal(later, res[0][3])
        assert set(full.unique().tolist()) == {0.0, 2.0}
    assert torch.equal(res[0][0], res[1][0])  # mesh dim 1 replicates
    assert not torch.equal(res[0][0], res[2][0])  # mesh dim 0 shards
    assert torch.equal(res[0][2][:4], res[0][0])


def test_random_op_costs_one_small_all_reduce():
    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        torch.manual_seed(1)
        x = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0), Shard(1)])
        with comm.recording() as log:
            x.normal_()
            F.dropout(x, 0.3)
        return [(e.kind, e.shape, e.dtype) for e in log.of_rank(comm.current_transport().rank)]

    for events in run_spmd(body, 4):
        assert events == [("all_reduce", (2,), torch.int64)] * 2  # 16 bytes each
