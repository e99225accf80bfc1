"""DTensor unit tests as a torch user writes them: torch's names, torch's threaded harness
(``DTensorOpTestBase``) and torch's test models and TP recipe (``common_dtensor``), unchanged.
``tests/test_dropin.py`` runs this file under ``python -m shardtensor.dropin``, which makes every
torch.distributed.tensor name below shardtensor's.  Run alone, it tests torch's DTensor."""
import copy
import os

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import (DTensorConverter, DTensorOpTestBase,
                                                                        MLPModule, ModelArgs, Transformer)

def _same_on_every_thread(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Values from a private generator: the threads (ranks) share torch's global one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


EXPECT = os.environ.get("EXPECT_DTENSOR_MODULE")  # the drop-in test asks that DTensor be shardtensor's


class DTensorBasics(DTensorOpTestBase):
    @property
    def world_size(self) -> int:
        return 4

    def test_dtensor_is_the_expected_one(self) -> None:
        if EXPECT:
            self.assertTrue(DTensor.__module__.startswith(EXPECT), DTensor.__module__)
            self.assertTrue(type(self.build_device_mesh()).__module__.startswith(EXPECT))

    def test_distribute_redistribute_full_tensor(self) -> None:
        mesh = self.build_device_mesh()
        full = torch.arange(24.0).reshape(8, 3)
        x = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(x.to_local(), full[2 * self.rank:2 * self.rank + 2])
        self.assertEqual(x.redistribute(mesh, [Replicate()]).to_local(), full)
        self.assertEqual(x.redistribute(mesh, [Shard(1)]).full_tensor(), full)
        p = DTensor.from_local(full, mesh, [Partial()])
        self.assertEqual(p.full_tensor(), full * 4)

    def test_comm_debug_mode_counts(self) -> None:
        mesh = self.build_device_mesh()
        funcol = torch.ops.c10d_functional
        x = distribute_tensor(torch.arange(24.0).reshape(8, 3), mesh, [Shard(0)])
        with CommDebugMode() as comm_mode:
            x.redistribute(mesh, [Replicate()])
        self.assertEqual(comm_mode.get_comm_counts()[funcol.all_gather_into_tensor], 1)
        self.assertEqual(comm_mode.get_total_counts(), 1)
        p = DTensor.from_local(torch.ones(4), mesh, [Partial()])
        with CommDebugMode() as comm_mode:
            p.redistribute(mesh, [Replicate()])
        self.assertEqual(comm_mode.get_comm_counts(), {funcol.all_reduce: 1})

    def test_partials_pass_elementwise_ops_with_the_fewest_collectives(self) -> None:
        """The checks of torch's test_partial_propagation and test_mul_partial (our words):
        maximum/minimum of Partial(max)/Partial(min) operands communicate nothing and keep the
        kind; P * P reduces one factor (one collective) and stays Partial; P * scalar/R stays
        Partial with none; a Partial(max) times a Replicate is reduced."""
        mesh = self.build_device_mesh()
        for op, kind in ((torch.maximum, "max"), (torch.minimum, "min")):
            a = DTensor.from_local(torch.full((8, 8), float(self.rank)), mesh, [Partial(kind)])
            b = DTensor.from_local(torch.full((8, 8), float(4 - self.rank)), mesh, [Partial(kind)])
            with CommDebugMode() as comm_mode:
                c = op(a, b)
            self.assertEqual(comm_mode.get_total_counts(), 0)
            self.assertEqual(c.placements, (Partial(kind),))
            self.assertEqual(c.full_tensor(), torch.full((8, 8), 4.0 if kind == "max" else 0.0))
        p1 = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()])
        p2 = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()])
        with CommDebugMode() as comm_mode:
            p3 = p1 * p2
        self.assertEqual(comm_mode.get_total_counts(), 1)
        self.assertEqual(p3.placements, (Partial(),))
        self.assertEqual(p3.to_local(), torch.full((2, 2), 4.0))
        self.assertEqual(p3.full_tensor(), torch.full((2, 2), 16.0))
        for kind in ("sum", "avg"):
            x = DTensor.from_local(torch.ones(8, 8), mesh, [Partial(kind)])
            for other in (2.0, torch.tensor(2.0), distribute_tensor(torch.full((8, 8), 2.0), mesh, [Replicate()])):
                with CommDebugMode() as comm_mode:
                    z = x * other
                self.assertEqual(comm_mode.get_total_counts(), 0)
                self.assertEqual(z.placements, (Partial(kind),))
                self.assertEqual(z.full_tensor(), torch.full((8, 8), 8.0 if kind == "sum" else 2.0))
        m = DTensor.from_local(torch.ones(8, 8), mesh, [Partial("max")])
        z = m * distribute_tensor(torch.ones(8, 8), mesh, [Replicate()])
        self.assertEqual(z.placements, (Replicate(),))
        self.assertEqual(z.to_local(), torch.ones(8, 8))

    def test_ops_through_torchs_converter(self) -> None:
        mesh = self.build_device_mesh()
        g = torch.Generator().manual_seed(0)
        a, b, v = torch.randn(8, 4, generator=g), torch.randn(4, 12, generator=g), torch.randn(8, 4, generator=g)
        cases = [(torch.add, (a, v), {}), (torch.mm, (a, b), {}), (torch.sum, (a,), {"dim": 1}),
                 (F.softmax, (a,), {"dim": 0}), (torch.where, (a > 0, a, v), {}), (torch.cumsum, (b,), {"dim": 1})]
        for op, args, kwargs in cases:
            want = op(*args, **kwargs)
            conv = DTensorConverter(mesh, args, kwargs)
            for d_args, d_kwargs in conv:
                self.assertTrue(conv.successful())
                self.assertEqual(op(*d_args, **d_kwargs).full_tensor(), want)

    def test_mlp_tp_forward_backward(self) -> None:
        mesh = self.build_device_mesh()
        ref = _same_on_every_thread(MLPModule("cpu"), 1)
        model = parallelize_module(copy.deepcopy(ref), mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
        x = torch.randn(5, 10, generator=torch.Generator().manual_seed(1))
        model(x).sum().backward()
        ref(x).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            self.assertEqual(p.full_tensor(), q, msg=name)
            self.assertEqual(p.grad.full_tensor(), q.grad, msg=name)

    def _transformer(self, seq_parallel: bool) -> None:
        mesh = self.build_device_mesh()
        args = ModelArgs(dropout_p=0.0, n_layers=2, vocab_size=16, dim=16, n_heads=4, max_seq_len=8)
        ref = _same_on_every_thread(Transformer(args), 2)
        model = Transformer.parallelize(copy.deepcopy(ref), mesh, use_seq_parallel=seq_parallel)
        tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(3))
        out, want = model(tokens), ref(tokens)
        self.assertEqual(out.full_tensor() if isinstance(out, DTensor) else out, want, atol=1e-5, rtol=1e-5)
        want.sum().backward()
        (out.full_tensor() if isinstance(out, DTensor) else out).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            self.assertEqual(got, q.grad, atol=1e-5, rtol=1e-5, msg=name)

    def test_transformer_tp(self) -> None:
        self._transformer(seq_parallel=False)

    def test_transformer_tp_sequence_parallel(self) -> None:
        self._transformer(seq_parallel=True)


if __name__ == "__main__":
    run_tests()
