"""Transport over torch.distributed: gloo on CPU, NCCL on GPU, and torch's ``fake`` test backend.

Groups are created once per distinct rank tuple, by every process in the same order (mesh
construction does that), each with the collective timeout.  Where the backend's collective
moves more bytes than the model (gloo's reduce-scatter) or lacks the reduce op (gloo has no
``avg``), the transition is built from collectives that keep the model.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .base import DEFAULT_TIMEOUT_S, Group, Transport, reduce_stack

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


class TorchDistTransport(Transport):
    """This process's rank in the default torch.distributed process group."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = str(dist.get_backend())
        self.name = f"torch.distributed/{self.backend}"
        self.timeout = timedelta(seconds=timeout)
        self._groups: dict[Group, dist.ProcessGroup] = {}

    def prepare_groups(self, groups: list[Group]) -> None:
        for g in groups:
            key = tuple(sorted(g))
            if len(key) > 1 and key not in self._groups:
                self._groups[key] = dist.new_group(list(key), timeout=self.timeout)

    def _pg(self, group: Group) -> tuple[dist.ProcessGroup, list[int] | None]:
        """Process group and, if the group's order is not ascending, the permutation to apply."""
        key = tuple(sorted(group))
        if key not in self._groups:
            raise RuntimeError(f"no process group for ranks {group}; build meshes on every rank in the same order")
        perm = None if key == group else [key.index(r) for r in group]
        return self._groups[key], perm

    def _native_avg(self) -> bool:
        return self.backend == "nccl"

    def all_gather(self, t, group):
        if len(group) == 1:
            return t.detach().clone().unsqueeze(0)
        pg, perm = self._pg(group)
        t = t.detach().contiguous()
        out = torch.empty((len(group), *t.shape), dtype=t.dtype, device=t.device)
        if self.backend == "gloo":
            dist.all_gather(list(out.unbind(0)), t, group=pg)
        else:
            dist.all_gather_into_tensor(out, t, group=pg)
        return out if perm is None else out[perm]

    def all_reduce(self, t, op, group):
        out = t.detach().clone(memory_format=torch.contiguous_format)
        if len(group) == 1:
            return out
        pg, _ = self._pg(group)
        if op == "avg" and not self._native_avg():
            dist.all_reduce(out, dist.ReduceOp.SUM, group=pg)
            return out / len(group) if out.is_floating_point() else out // len(group)
        dist.all_reduce(out, dist.ReduceOp.AVG if op == "avg" else _OPS[op], group=pg)
        return out

    def reduce_scatter(self, t, op, group):
        if len(group) == 1:
            return t.detach()[0].clone()
        if self.backend == "gloo" or (op == "avg" and not self._native_avg()):
            return reduce_stack(self.all_to_all(t, group), op)
        pg, perm = self._pg(group)
        t = t.detach()
        if perm is not None:
            t = t[[group.index(r) for r in sorted(group)]]
        out = torch.empty(t.shape[1:], dtype=t.dtype, device=t.device)
        dist.reduce_scatter_tensor(out, t.contiguous(), op=dist.ReduceOp.AVG if op == "avg" else _OPS[op], group=pg)
        return out

    def all_to_all(self, t, group):
        if len(group) == 1:
            return t.detach().clone()
        pg, perm = self._pg(group)
        t = t.detach()
        if perm is not None:
            t = t[[group.index(r) for r in sorted(group)]]
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=pg)
        return out if perm is None else out[perm]

    def broadcast(self, t, src, group):
        out = t.detach().clone(memory_format=torch.contiguous_format)
        if len(group) == 1:
            return out
        pg, _ = self._pg(group)
        dist.broadcast(out, src=group[src], group=pg)
        return out

    def barrier(self, group):
        if len(group) > 1:
            pg, _ = self._pg(group)
            dist.barrier(group=pg)
