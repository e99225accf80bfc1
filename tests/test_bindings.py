"""The hit path's local kernels: torch's Python binding of an op only where it provably calls the op."""
from __future__ import annotations

import torch

import shardtensor as st
from shardtensor import Replicate, Shard, distribute_tensor, init_device_mesh, run_spmd
from shardtensor.dispatch.bindings import local_kernel
from shardtensor.propagation.engine import HOT

aten = torch.ops.aten


def test_a_binding_that_dispatches_the_op_is_taken():
    t = torch.randn(4, 3)
    assert local_kernel(aten.add.Tensor, [t, t], {}) is torch._C._VariableFunctions.add
    assert local_kernel(aten.sum.dim_IntList, [t, [0]], {}) is torch._C._VariableFunctions.sum
    assert local_kernel(aten.view.default, [t, [3, 4]], {}) is torch._C.TensorBase.view
    assert local_kernel(aten.add.Tensor, [t, t], {"alpha": 2}) is torch._C._VariableFunctions.add


def test_a_binding_that_calls_another_overload_or_decomposes_is_not_taken():
    t = torch.randn(4, 3)
    # torch.add(t, 2.0) wraps the scalar: it dispatches add.Tensor, not add.Scalar
    assert local_kernel(aten.add.Scalar, [t, 2.0], {}) is aten.add.Scalar
    # reshape is a composite: its binding dispatches view, never reshape
    assert local_kernel(aten.reshape.default, [t, [12]], {}) is aten.reshape.default
    # arguments the binding rejects
    assert local_kernel(aten.add.Tensor, [t, "no"], {}) is aten.add.Tensor


def test_ops_that_return_a_list_of_tensors_keep_the_op():
    """A binding returns a tuple where the op returns a list, which the dispatcher needs back."""
    t = torch.randn(4, 3)
    xs = [torch.randn(2), torch.randn(3)]
    assert local_kernel(aten._foreach_add.List, [xs, xs], {}) is aten._foreach_add.List
    assert local_kernel(aten.unbind.int, [t, 0], {}) is aten.unbind.int


def test_choosing_a_binding_writes_nothing():
    t = torch.ones(3)
    version = t._version
    kernel = local_kernel(aten.add_.Tensor, [t, torch.ones(3)], {})
    assert kernel is torch._C.TensorBase.add_
    assert torch.equal(t, torch.ones(3))
    xs = [torch.ones(2), torch.ones(3)]
    kernel = local_kernel(aten._foreach_mul_.Scalar, [xs, 5.0], {})
    assert kernel is torch._C._VariableFunctions._foreach_mul_
    assert all(torch.equal(x, torch.ones_like(x)) for x in xs)
    assert t._version >= version


def test_subclass_local_tensors_keep_the_op():
    class Sub(torch.Tensor):
        pass

    t = torch.randn(3).as_subclass(Sub)
    assert local_kernel(aten.neg.default, [t], {}) is aten.neg.default


def test_cached_calls_run_through_bindings_and_match_dense():
    """The entries the hit path keeps name their kernels; results equal dense torch on every rank,
    with keyword arguments, in-place ops and reductions."""
    a, b = torch.randn(8, 6), torch.randn(8, 6)

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(a, mesh, [Shard(0), Replicate()])
        y = distribute_tensor(b, mesh, [Shard(0), Replicate()])
        outs = []
        for _ in range(3):  # the first call decides, the next ones hit
            outs = [torch.add(x, y, alpha=2.0), x * 3.0, x.sum(1), torch.softmax(x, -1), x.clone().mul_(y),
                    x.t(), torch.sub(y, x, alpha=0.5)]
        kernels = {e[2] for e in HOT.values()}
        return [o.full_tensor() for o in outs], kernels

    want = [a + 2.0 * b, a * 3.0, a.sum(1), torch.softmax(a, -1), a * b, a.t(), b - 0.5 * a]
    for outs, kernels in run_spmd(body, 4):
        for o, w in zip(outs, want):
            torch.testing.assert_close(o, w)
        assert torch._C._VariableFunctions.add in kernels
        assert torch._C.TensorBase.mul_ in kernels


def test_a_dispatch_mode_sees_the_same_ops_through_a_binding():
    """A user's dispatch mode around cached calls still sees the local ops the hit path runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    mesh = st.init_device_mesh("cpu", (1,))
    x = distribute_tensor(torch.randn(4), mesh, [Replicate()])
    x + x
    with Log():
        y = x + x
    assert aten.add.Tensor in seen
    torch.testing.assert_close(y.full_tensor(), 2 * x.full_tensor())
