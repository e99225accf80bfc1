"""Transport over torch.distributed: gloo on CPU, NCCL on GPU, and torch's ``fake`` test backend.

Groups are created once per distinct rank tuple, by every process in the same order (mesh
construction does that), each with the collective timeout.  Where the backend's collective
moves more bytes than the model (gloo's reduce-scatter) or lacks the reduce op (gloo has no
``avg``), the transition is built from collectives that keep the model.

``async_op=True`` issues torch.distributed's own asynchronous collective; the local steps
(group-order permutation, gloo's sum-then-divide ``avg``, gloo's reduce-scatter reduction)
run when the returned ``Work`` is waited on.
"""
from __future__ import annotations

import itertools
import math
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeoutError
from .base import DEFAULT_TIMEOUT_S, Completed, Group, Transport, Work, avg_divide, reduce_stack

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


# the tensor forms of all-gather and reduce-scatter; torch 2.13 renamed them (``*_single``) and
# the old names warn on every call, which costs as much as the call itself on small tensors
_SERIALS = itertools.count()  # Transport.group_serial
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TorchDistTransport(Transport):
    """This process's rank in the default torch.distributed process group."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = str(dist.get_backend())
        self.name = f"torch.distributed/{self.backend}"
        self.group_serial = next(_SERIALS) if self.backend != "threaded" else -1  # threaded: ranks are threads
        self.timeout = timedelta(seconds=timeout)
        self._groups: dict[Group, dist.ProcessGroup] = {}
        self._found: dict[Group, tuple[dist.ProcessGroup, list[int] | None]] = {}  # _pg's answers

    def prepare_groups(self, groups: list[Group]) -> None:
        for g in groups:
            key = tuple(sorted(g))
            if len(key) > 1 and key not in self._groups:
                self._groups[key] = dist.new_group(list(key), timeout=self.timeout)

    def process_group(self, group: Group) -> dist.ProcessGroup:
        if len(group) > 1:
            return self._pg(group)[0]
        key = tuple(group)  # a group of one: only its member need build it
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key), timeout=self.timeout, use_local_synchronization=True)
        return self._groups[key]

    def _pg(self, group: Group) -> tuple[dist.ProcessGroup, list[int] | None]:
        """Process group and, if the group's order is not ascending, the permutation to apply."""
        got = self._found.get(group)
        if got is None:
            key = tuple(sorted(group))
            if key not in self._groups:
                raise RuntimeError(f"no process group for ranks {group}; build meshes on every rank in the same order")
            got = self._found[group] = (self._groups[key], None if key == group else [key.index(r) for r in group])
        return got

    def _native_avg(self) -> bool:
        return self.backend == "nccl"

    def all_gather(self, t, group, *, async_op=False):
        if len(group) == 1:
            out = t.detach().clone().unsqueeze(0)
            return Completed(out) if async_op else out
        pg, perm = self._pg(group)
        t = t.detach().contiguous()
        out = torch.empty((len(group), *t.shape), dtype=t.dtype, device=t.device)
        if async_op:
            if self.backend == "gloo":
                work = dist.all_gather(list(out.unbind(0)), t, group=pg, async_op=True)
            else:
                work = _ALL_GATHER(out, t, group=pg, async_op=True)
            return _pending(work, out, t, None if perm is None else (lambda x: x[perm]))
        if self.backend == "gloo":
            dist.all_gather(list(out.unbind(0)), t, group=pg)
        else:
            _ALL_GATHER(out, t, group=pg)
        return out if perm is None else out[perm]

    def all_reduce(self, t, op, group, *, async_op=False):
        out = t.detach().clone(memory_format=torch.contiguous_format)
        if len(group) == 1:
            return Completed(out) if async_op else out
        pg, _ = self._pg(group)
        if op == "avg" and not self._native_avg():
            k = len(group)
            if async_op:
                work = dist.all_reduce(out, dist.ReduceOp.SUM, group=pg, async_op=True)
                return _pending(work, out, None, lambda x: avg_divide(x, k))
            dist.all_reduce(out, dist.ReduceOp.SUM, group=pg)
            return avg_divide(out, k)
        if async_op:
            work = dist.all_reduce(out, dist.ReduceOp.AVG if op == "avg" else _OPS[op], group=pg, async_op=True)
            return _pending(work, out)
        dist.all_reduce(out, dist.ReduceOp.AVG if op == "avg" else _OPS[op], group=pg)
        return out

    def reduce_scatter(self, t, op, group, *, async_op=False):
        if len(group) == 1:
            out = t.detach()[0].clone()
            return Completed(out) if async_op else out
        if self.backend == "gloo" or (op == "avg" and not self._native_avg()) or (
                self.backend == "threaded" and op != "sum"):  # torch's threaded test group: sum only
            if async_op:
                return self.all_to_all(t, group, async_op=True).then(lambda x: reduce_stack(x, op))
            return reduce_stack(self.all_to_all(t, group), op)
        pg, perm = self._pg(group)
        t = t.detach()
        if perm is not None:
            t = t[[group.index(r) for r in sorted(group)]]
        out = torch.empty(t.shape[1:], dtype=t.dtype, device=t.device)
        t = t.contiguous().view(-1)  # the flat forms every torch version (and its threaded group) takes
        rop = dist.ReduceOp.AVG if op == "avg" else _OPS[op]
        if async_op:
            return _pending(_REDUCE_SCATTER(out.view(-1), t, op=rop, group=pg, async_op=True), out, t)
        _REDUCE_SCATTER(out.view(-1), t, op=rop, group=pg)
        return out

    def all_to_all(self, t, group, *, async_op=False):
        if len(group) == 1:
            out = t.detach().clone()
            return Completed(out) if async_op else out
        pg, perm = self._pg(group)
        t = t.detach()
        if perm is not None:
            t = t[[group.index(r) for r in sorted(group)]]
        t = t.contiguous()
        out = torch.empty_like(t)
        if async_op:
            work = dist.all_to_all_single(out, t, group=pg, async_op=True)
            return _pending(work, out, t, None if perm is None else (lambda x: x[perm]))
        dist.all_to_all_single(out, t, group=pg)
        return out if perm is None else out[perm]

    def all_to_all_v(self, sends, recv_shapes, group, *, async_op=False):
        if len(group) == 1:
            out1 = [sends[0].detach().clone()]
            return Completed(out1) if async_op else out1
        pg, _ = self._pg(group)
        key = sorted(group)
        pos = [group.index(r) for r in key]  # process-group rank i is group rank pos[i]
        ref = sends[0]
        flat = torch.cat([sends[i].detach().reshape(-1) for i in pos])
        sizes = [math.prod(recv_shapes[i]) for i in pos]
        out = torch.empty(sum(sizes), dtype=ref.dtype, device=ref.device)

        def unpack(buf: torch.Tensor) -> list:
            got: list = [None] * len(group)
            for i, piece in zip(pos, buf.split(sizes)):
                got[i] = piece.view(recv_shapes[i])
            return got

        if async_op:
            work = dist.all_to_all_single(out, flat, sizes, [sends[i].numel() for i in pos], group=pg, async_op=True)
            return _pending(work, out, flat, unpack)
        dist.all_to_all_single(out, flat, sizes, [sends[i].numel() for i in pos], group=pg)
        return unpack(out)

    def broadcast(self, t, src, group):
        out = t.detach().clone(memory_format=torch.contiguous_format)
        if len(group) == 1:
            return out
        pg, _ = self._pg(group)
        dist.broadcast(out, src=group[src], group=pg)
        return out

    def send_recv(self, sends, recvs):
        ops = ([dist.P2POp(dist.isend, t.detach().contiguous(), p) for p, t in sends]
               + [dist.P2POp(dist.irecv, buf, p) for p, buf in recvs])
        if not ops:
            return
        labels = [f"a send to rank {p}" for p, _ in sends] + [f"a receive from rank {p}" for p, _ in recvs]
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # coalesced (NCCL): one handle for all
            labels = ["an exchange with ranks " + str(sorted({p for p, _ in sends} | {p for p, _ in recvs}))]
        for label, work in zip(labels, works):
            try:
                work.wait(timeout=self.timeout) if self.backend == "gloo" else work.wait()
            except RuntimeError as e:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: {label} failed or timed out after {self.timeout.total_seconds():.0f}s ({e}); "
                    "that rank never took part, or planned a different move") from e

    def barrier(self, group):
        if len(group) > 1:
            pg, _ = self._pg(group)
            if self.backend == "nccl":  # NCCL's barrier runs on a device: name it, as torch asks
                dist.barrier(group=pg, device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier(group=pg)


def _pending(work: dist.Work, out: torch.Tensor, keep: torch.Tensor | None = None,
             post: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Work:
    """Wrap a torch.distributed work whose result lands in ``out``.

    ``keep`` (the send buffer) stays referenced until the wait, so it cannot be freed while
    the backend may still read it.
    """
    return Work(lambda: (work.wait(), keep, out)[2], work.is_completed, post)
