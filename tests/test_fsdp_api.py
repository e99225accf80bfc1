"""FSDP2's ``fully_shard`` arguments and ``FSDPModule`` methods that trainers call (torchtitan:
the list form, gradient division off, sum-only reductions, no reshard after backward while
accumulating, ``unshard(async_op=True)``, ignored parameters, the offload policy), against one
device and by the collectives they issue, in the simulated world."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardtensor import DTensor, Shard, comm, init_device_mesh, run_spmd
from shardtensor.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

WORLD = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.norm, self.out = nn.Linear(4, 6), nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.mid(self.inp(x)))))


def _net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)


def _dense_grads(scale: float) -> dict[str, torch.Tensor]:
    model = _net()
    x, y = _data(0)
    (((model(x) - y) ** 2).sum() * scale).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _sharded_grads(configure, scale: float):
    """Each rank's loss is the sum over its rows times ``scale``; ``configure(model)`` applies FSDP."""
    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _net()
        configure(model, mesh)
        x, y = _data(0)
        r = mesh.get_local_rank()
        with comm.recording() as log:
            (((model(x[2 * r: 2 * r + 2]) - y[2 * r: 2 * r + 2]) ** 2).sum() * scale).backward()
        kinds = [e.kind for e in log.of_rank(mesh.get_rank())]
        return {n: p.grad.full_tensor() for n, p in model.named_parameters()}, kinds
    return run_spmd(fn, WORLD)


def _plain(model, mesh):
    fully_shard(model.mid, mesh=mesh)
    fully_shard([model.norm, model.out], mesh=mesh)
    fully_shard(model, mesh=mesh)


def test_list_form_is_one_unit_gathered_once_and_grads_equal_one_device():
    dense = _dense_grads(1 / WORLD)  # the default divides the summed gradients by dp
    for grads, kinds in _sharded_grads(_plain, 1.0):
        for n, g in grads.items():
            torch.testing.assert_close(g, dense[n], msg=n)
        # root, mid, [norm, out] once each in forward, mid and [norm, out] again in backward
        assert kinds.count("all_gather") == 5 and kinds.count("reduce_scatter") == 3

    def fn():
        model = _net()
        _plain(model, init_device_mesh("cpu", (WORLD,)))
        return (isinstance(model.norm, FSDPModule), model.norm._fsdp_state is model.out._fsdp_state,
                isinstance(model.out.weight, DTensor))
    assert run_spmd(fn, WORLD)[0] == (True, True, True)


@pytest.mark.parametrize("force_sum", [False, True])
def test_gradient_divide_factor_replaces_the_division_by_dp(force_sum):
    def configure(model, mesh):
        _plain(model, mesh)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(force_sum)
    dense = _dense_grads(1.0)  # a plain sum of the ranks' gradients: the loss of the whole batch
    for grads, _ in _sharded_grads(configure, 1.0):
        for n, g in grads.items():
            torch.testing.assert_close(g, dense[n], msg=n)

    def halves(model, mesh):
        configure(model, mesh)
        model.mid.set_gradient_divide_factor(4.0)  # one module's own factor
    for grads, _ in _sharded_grads(halves, 1.0):
        torch.testing.assert_close(grads["mid.weight"], dense["mid.weight"] / 4)
        torch.testing.assert_close(grads["inp.weight"], dense["inp.weight"])


def test_set_gradient_divide_factor_checks_its_argument():
    def fn():
        model = _net()
        fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
        model.set_gradient_divide_factor(0)
    with pytest.raises(ValueError, match="factor must be a positive number"):
        run_spmd(fn, WORLD)


def test_no_reshard_after_backward_skips_the_next_gather_and_unshard_async_prefetches():
    """Gradient accumulation as torchtitan does it: the first microbatch neither reduces nor
    reshards, so the second gathers nothing for that module; ``unshard(async_op=True)`` then
    ``wait()`` before a forward leaves that forward nothing to gather."""
    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _net()
        _plain(model, mesh)
        dense = _net()
        me = mesh.get_rank()
        seen = []
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            model.mid.set_reshard_after_backward(micro == 1)
            x, y = _data(micro)
            with comm.recording() as log:
                ((model(x[2 * me: 2 * me + 2]) - y[2 * me: 2 * me + 2]) ** 2).sum().backward()
            seen.append([e.kind for e in log.of_rank(me)])
            ((dense(x) - y) ** 2).sum().div(WORLD).backward()
        handle = model.mid.unshard(async_op=True)
        handle.wait()
        with comm.recording() as log:
            model(torch.zeros(1, 4, dtype=torch.float64))
        grads = [(p.grad.full_tensor(), q.grad) for p, q in zip(model.parameters(), dense.parameters())]
        return seen, [e.kind for e in log.of_rank(me)], grads

    for seen, after_wait, grads in run_spmd(fn, WORLD):
        assert seen[0] == ["all_gather"] * 5  # nothing reduced while accumulating
        assert seen[1].count("all_gather") == 4 and seen[1].count("reduce_scatter") == 3  # mid's forward kept it
        assert after_wait.count("all_gather") == 2  # mid's came from unshard(async_op=True)
        for ours, dense in grads:
            torch.testing.assert_close(ours, dense)


def test_ignored_params_stay_plain_and_unreduced():
    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _net()
        fully_shard(model, mesh=mesh, ignored_params={model.norm.weight, model.norm.bias})
        x, y = _data(0)
        ((model(x) - y) ** 2).sum().backward()
        return type(model.norm.weight), isinstance(model.out.weight, DTensor), model.norm.weight.grad
    dense = _dense_grads(1.0)
    for kind, sharded, g in run_spmd(fn, WORLD):
        assert kind is nn.Parameter and sharded
        torch.testing.assert_close(g, dense["norm.weight"])  # the whole batch on every rank, no reduction


def test_refused_arguments_name_themselves_and_leave_the_module_alone():
    def fn(kwargs):
        model = _net()
        mesh = init_device_mesh("cpu", (WORLD,))
        try:
            fully_shard(model, mesh=mesh, **kwargs)
        finally:
            assert not isinstance(model, FSDPModule) and not isinstance(model.inp.weight, DTensor)
    for kwargs, match in [({"reshard_after_forward": 2}, "reshard_after_forward=2"),
                          ({"dp_mesh_dims": object()}, "dp_mesh_dims"),
                          ({"offload_policy": "cpu"}, "offload_policy must be an OffloadPolicy"),
                          ({"shard_placement_fn": lambda p: nn.Module()}, "shard_placement_fn")]:
        with pytest.raises((NotImplementedError, TypeError), match=match):
            run_spmd(fn, WORLD, kwargs)


def test_cpu_offload_holds_for_parameters_on_the_cpu():
    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _net()
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
        x, y = _data(0)
        ((model(x) - y) ** 2).sum().backward()
        return {p.grad.device.type for p in model.parameters()}, isinstance(CPUOffloadPolicy(), OffloadPolicy)
    assert run_spmd(fn, WORLD)[0] == ({"cpu"}, True)


def test_chunked_loss_over_a_list_unit_as_torchtitan_calls_it():
    """torchtitan's chunked loss: the model runs the list unit's ``norm``, then the loss calls its
    ``out`` once per chunk with a backward after each (no reshard, gradient sync only on the
    last chunk); two steps equal one device, and every parameter is sharded after each."""
    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        model, dense = _net(), _net()
        fully_shard(model.mid, mesh=mesh)
        fully_shard([model.norm, model.out], mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, dense)]
        me, out = mesh.get_rank(), []
        for step in range(2):
            x, y = _data(step)
            for m, rows in ((model, slice(2 * me, 2 * me + 2)), (dense, slice(None))):
                h = m.norm(torch.tanh(m.mid(m.inp(x[rows])))) if m is dense else _hidden(m, x[rows])
                chunks = [c.detach().requires_grad_() for c in h.detach().chunk(2)]
                if m is model:
                    m.out.set_reshard_after_backward(False)
                    m.out.set_requires_gradient_sync(False, recurse=False)
                    m.out.unshard()
                grads = []
                for i, (c, t) in enumerate(zip(chunks, y[rows].chunk(2))):
                    if m is model and i == 1:
                        m.out.set_requires_gradient_sync(True, recurse=False)
                        m.out.set_reshard_after_backward(True)
                    ((m.out(c) - t) ** 2).sum().div(1 if m is model else WORLD).backward()
                    grads.append(c.grad)
                h.backward(torch.cat(grads))
            out.append(all(isinstance(p, DTensor) for p in model.parameters()))
            for (n, p), q in zip(model.named_parameters(), dense.parameters()):
                out.append((n, torch.allclose(p.grad.full_tensor(), q.grad)))
            for o in opts:
                o.step()
                o.zero_grad()
        return out
    for res in run_spmd(fn, WORLD):
        assert all(r if isinstance(r, bool) else r[1] for r in res), [r for r in res if r is False or (not isinstance(r, bool) and r[1] is False)]


def _hidden(model, x):
    """The model's forward up to the list unit's first module (the chunked loss runs the rest)."""
    saved = model.forward
    model.forward = lambda x: model.norm(torch.tanh(model.mid(model.inp(x))))
    try:
        return model(x)
    finally:
        model.forward = saved


class Scorer(Net):
    """A method other than ``forward`` reads the parameters itself (as a ``generate`` does), and
    calls ``forward`` inside."""

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return (self(x) * self.out.weight.sum(1)).sum(-1) + self.inp.bias.sum()


def test_register_fsdp_forward_method_gathers_for_the_method_and_its_inner_forwards():
    """FSDP2's ``register_fsdp_forward_method``: the method sees the unsharded parameters (its
    inner forward uses the same gather: one all-gather per group), gradients equal one device;
    unregistered, the method meets the shards and fails; ``share_comm_ctx`` checks its modules."""
    from shardtensor.fsdp import register_fsdp_forward_method, share_comm_ctx

    torch.manual_seed(0)
    dense = Scorer().double()
    x, _ = _data(0)
    dense.score(x).sum().backward()

    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(0)
        model = Scorer().double()
        fully_shard(model.mid, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with pytest.raises(Exception):
            model.score(x)  # the root's own parameters are shards outside forward
        register_fsdp_forward_method(model, "score")
        register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not an FSDP module: left alone
        with pytest.raises(ValueError, match="no method 'scor'"):
            register_fsdp_forward_method(model, "scor")
        share_comm_ctx([model, model.mid])
        with pytest.raises(ValueError, match="FSDP modules, got Linear"):
            share_comm_ctx([model, nn.Linear(2, 2)])
        r = mesh.get_local_rank()
        with comm.recording() as log:
            s = model.score(x[2 * r: 2 * r + 2])
        gathers = [e.kind for e in log.of_rank(mesh.get_rank())].count("all_gather")
        s.sum().backward()
        scores = DTensor.from_local(s.detach(), mesh, [Shard(0)]).full_tensor()  # every rank's rows
        return scores, gathers, {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    for scores, gathers, grads in run_spmd(fn, WORLD):
        torch.testing.assert_close(scores, dense.score(x))
        assert gathers == 2  # the root's group and mid's
        for n, p in dense.named_parameters():  # FSDP averages the ranks' gradients
            torch.testing.assert_close(grads[n], p.grad / WORLD, msg=n)



def test_dp_mesh_dims_hsdp_on_the_whole_mesh_and_refusals():
    """``dp_mesh_dims`` naming a shard and a replicate dim of a 2-D mesh (HSDP on a full-DTensor
    model): the unsharded parameters are DTensors on that mesh again, the gradients of a global
    loss (Partial over both dims) come back averaged over the 4 ranks, as FSDP2; bad names and
    plain parameters are refused naming themselves."""
    from shardtensor import Replicate, distribute_tensor
    from shardtensor.fsdp import DataParallelMeshDims

    dense = _net()
    x, y = _data(0)
    ((dense(x) - y) ** 2).mean().backward()

    def fn():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        model = _net()
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                mod._parameters[name] = nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate(), Replicate()]))
        with pytest.raises(ValueError, match="names 'dp', which is not a dim"):
            fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        with pytest.raises(NotImplementedError, match="several mesh dims"):
            fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("rep", "shard")))
        with pytest.raises(ValueError, match="at least one of shard and replicate"):
            DataParallelMeshDims()
        with pytest.raises(ValueError, match="must be a DTensor on the mesh"):
            fully_shard(_net(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="shard", replicate="rep"))
        dims = DataParallelMeshDims(shard="shard", replicate="rep")
        fully_shard(model.mid, mesh=mesh, dp_mesh_dims=dims)
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
        assert model.mid.weight.placements == (Replicate(), Shard(0))
        xd, yd = (distribute_tensor(t, mesh, [Shard(0), Shard(0)]) for t in (x, y))
        ((model(xd) - yd) ** 2).mean().backward()
        return {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    for grads in run_spmd(fn, 4):
        for n, p in dense.named_parameters():
            torch.testing.assert_close(grads[n], p.grad / 4, msg=n)


@pytest.mark.parametrize("force_sum", [False, True])
def test_hsdp_accumulates_with_reduce_scatters_only_until_the_all_reduce(force_sum):
    """FSDP2's ``set_requires_all_reduce(False)`` on HSDP (2 replicas x 2 shards): microbatches
    reduce-scatter only, set no ``.grad``, and the last (all-reduce on) all-reduces the sum of
    the blocks once; gradients equal one device's over all microbatches / 4."""
    dense = _net()
    for step in range(3):
        x, y = _data(step)
        ((dense(x) - y) ** 2).sum().backward()

    def fn():
        mesh = init_device_mesh("cpu", (2, 2))
        model = _net()
        fully_shard(model.mid, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_force_sum_reduction_for_comms(force_sum)
        kinds, nones = [], []
        r = mesh.get_rank()
        for step in range(3):
            model.set_requires_all_reduce(step == 2)
            x, y = _data(step)
            with comm.recording() as log:
                ((model(x[r: r + 1]) - y[r: r + 1]) ** 2).sum().backward()
            kinds.append(sorted({e.kind for e in log.of_rank(r)}))
            nones.append(all(p.grad is None for p in model.parameters()))
        return kinds, nones, {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    for kinds, nones, grads in run_spmd(fn, 4):
        assert kinds[:2] == [["all_gather", "reduce_scatter"]] * 2 and "all_reduce" in kinds[2], kinds
        assert nones == [True, True, False]
        for n, p in dense.named_parameters():
            torch.testing.assert_close(grads[n], p.grad / 4, msg=n)
