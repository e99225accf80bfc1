"""FSDP2's ``fully_shard`` arguments and ``FSDPModule`` methods that trainers call (torchtitan:
the list form, gradient division off, sum-only reductions, no reshard after backward while
accumulating, ``unshard(async_op=True)``, ignored parameters, the offload policy), against one
device and by the collectives they issue, in the simulated world."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardtensor import DTensor, comm, init_device_mesh, run_spmd
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
