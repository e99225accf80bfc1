"""shardtensor under torch's threaded test process group (``MultiThreadedTestCase``): every
rank a thread of one process, as in torch's ``DTensorOpTestBase`` and downstream projects' unit
tests.  Each thread is a rank of torch.distributed; values are checked against one device."""
from __future__ import annotations

import unittest

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.testing._internal.common_utils import run_tests

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, fully_shard, init_device_mesh
from shardtensor.compile import methods_traced
from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _dense(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class ThreadedWorld(MultiThreadedTestCase):
    @property
    def world_size(self) -> int:
        return 4

    def setUp(self) -> None:
        super().setUp()
        self._spawn_threads()

    def test_transport_is_this_threads_rank(self) -> None:
        t = comm.current_transport()
        self.assertEqual((t.rank, t.world_size), (dist.get_rank(), 4))
        mesh = init_device_mesh("cpu", (2, 2))
        self.assertEqual(mesh.get_coordinate(), [dist.get_rank() // 2, dist.get_rank() % 2])

    def test_redistribute_every_pair_matches_one_device(self) -> None:
        full = _dense(7, 5)
        mesh = init_device_mesh("cpu", (2, 2))
        layouts = [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()], [Replicate(), Replicate()]]
        for src in layouts:
            x = distribute_tensor(full, mesh, src)
            for dst in layouts:
                y = x.redistribute(mesh, dst)
                self.assertEqual(y.placements, tuple(dst))
                torch.testing.assert_close(y.full_tensor(), full)
        rank = dist.get_rank()
        for op, term, want in (("sum", full / 4, full), ("max", full - rank, full), ("avg", full + rank - 1.5, full)):
            p = DTensor.from_local(term, mesh, [Partial(op), Partial(op)])  # each rank one term
            for dst in ([Shard(0), Replicate()], [Shard(1), Shard(0)], [Replicate(), Replicate()]):
                torch.testing.assert_close(p.redistribute(mesh, dst).full_tensor(), want, msg=f"{op} -> {dst}")

    def test_matmul_forward_and_backward(self) -> None:
        a, b = _dense(6, 5, seed=1), _dense(5, 3, seed=2)
        mesh = init_device_mesh("cpu", (4,))
        da = distribute_tensor(a, mesh, [Shard(1)]).requires_grad_()
        db = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_()
        out = da @ db
        out.sum().backward()
        ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
        (ra @ rb).sum().backward()
        torch.testing.assert_close(out.full_tensor(), ra @ rb)
        torch.testing.assert_close(da.grad.full_tensor(), ra.grad)
        torch.testing.assert_close(db.grad.full_tensor(), rb.grad)

    def test_get_group_is_torchs_threaded_group(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        for j, g in enumerate(mesh.get_all_groups()):
            ranks = dist.get_process_group_ranks(g)
            self.assertEqual(ranks, sorted(mesh.group_ranks(j)))
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t, group=g)
            self.assertEqual(t.item(), float(sum(ranks)))

    @unittest.skipIf(not methods_traced(), "get_group traces into compiled code from torch 2.13; on 2.11 any "
                     "torch.compile in these threads made a later test of the worker segfault (meta_mm)")
    def test_get_group_in_compiled_code_is_this_threads(self) -> None:
        """The ranks are threads sharing dynamo's cache: compiled code hands each rank its own
        group (read eagerly in these worlds, ``Transport.group_serial``), call after call."""
        mesh = init_device_mesh("cpu", (2, 2))

        def f(t: torch.Tensor) -> tuple:
            return t + 1, mesh.get_group(1)

        for _ in range(2):
            out, g = torch.compile(f, backend="eager")(torch.zeros(1))
            self.assertEqual(dist.get_process_group_ranks(g), sorted(mesh.group_ranks(1)))
            self.assertEqual(out.item(), 1.0)

    def test_tp_and_fsdp_train_as_one_device(self) -> None:
        def build() -> nn.Module:  # the threads share torch's global generator: values from a private one
            model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))
            g = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            return model

        x, y = _dense(8, 6, seed=4), _dense(8, 4, seed=5)
        ref = build()
        o = torch.optim.SGD(ref.parameters(), lr=0.1)
        ((ref(x) - y) ** 2).mean().backward()
        o.step()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(build(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        dp = mesh.get_local_rank("dp")
        o = torch.optim.SGD(model.parameters(), lr=0.1)
        ((model(x[dp * 4:(dp + 1) * 4]) - y[dp * 4:(dp + 1) * 4]) ** 2).mean().backward()
        o.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-5, msg=name)


if __name__ == "__main__":
    run_tests()
