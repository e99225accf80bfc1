"""Collectives as ``torch.library`` ops, for the graphs that ``torch.compile`` builds.

While torch.compile traces, shardtensor's dispatch runs once on fake tensors to decide
placements and plan redistributions; its collectives cannot run then.  Each is instead
recorded as one of the ops below (``shardtensor::all_gather`` and so on), whose fake
implementation gives the output's shape and whose real implementation, run by the compiled
graph, calls the same ``issue`` functions as eager code: the calling rank's transport, with
the collective recorded for ``CommTrace``.  The group is a list of global ranks, so a graph
holds no rank state of its own.
"""
from __future__ import annotations

from typing import Any

import torch

from .base import Group, MeshDims
from .issue import issue, issue_all_to_all_v, issue_broadcast

__all__ = ["traced", "traced_all_to_all_v"]


def _dims(mesh_dim: MeshDims) -> list[int]:
    if mesh_dim is None:
        return []
    return [mesh_dim] if isinstance(mesh_dim, int) else list(mesh_dim)


def _undims(dims: list[int]) -> MeshDims:
    return None if not dims else dims[0] if len(dims) == 1 else tuple(dims)


def _own(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A custom op's output may not alias its input (a group of one may hand ``t`` back)."""
    return out.clone() if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() else out


@torch.library.custom_op("shardtensor::all_gather", mutates_args=())
def _all_gather(t: torch.Tensor, group: list[int], dims: list[int]) -> torch.Tensor:
    return _own(issue("all_gather", tuple(group), _undims(dims), t), t)


@_all_gather.register_fake
def _(t, group, dims):
    return t.new_empty((len(group), *t.shape))


@torch.library.custom_op("shardtensor::all_reduce", mutates_args=())
def _all_reduce(t: torch.Tensor, op: str, group: list[int], dims: list[int]) -> torch.Tensor:
    return _own(issue("all_reduce", tuple(group), _undims(dims), t, (op,)), t)


@_all_reduce.register_fake
def _(t, op, group, dims):
    return torch.empty_like(t)


@torch.library.custom_op("shardtensor::reduce_scatter", mutates_args=())
def _reduce_scatter(t: torch.Tensor, op: str, group: list[int], dims: list[int]) -> torch.Tensor:
    return _own(issue("reduce_scatter", tuple(group), _undims(dims), t, (op,)), t)


@_reduce_scatter.register_fake
def _(t, op, group, dims):
    return t.new_empty(t.shape[1:])


@torch.library.custom_op("shardtensor::all_to_all", mutates_args=())
def _all_to_all(t: torch.Tensor, group: list[int], dims: list[int]) -> torch.Tensor:
    return _own(issue("all_to_all", tuple(group), _undims(dims), t), t)


@_all_to_all.register_fake
def _(t, group, dims):
    return torch.empty_like(t)


@torch.library.custom_op("shardtensor::broadcast", mutates_args=())
def _broadcast(t: torch.Tensor, src: int, group: list[int], dims: list[int]) -> torch.Tensor:
    return _own(issue_broadcast(t, src, tuple(group), _undims(dims)), t)


@_broadcast.register_fake
def _(t, src, group, dims):
    return torch.empty_like(t)


@torch.library.custom_op("shardtensor::all_to_all_v", mutates_args=())
def _all_to_all_v(sends: list[torch.Tensor], recv_sizes: list[int], recv_ndim: int, group: list[int],
                  dims: list[int]) -> list[torch.Tensor]:
    out = issue_all_to_all_v(sends, _shapes(recv_sizes, recv_ndim), tuple(group), _undims(dims))
    return [_own(o, s) for o, s in zip(out, sends)]


@_all_to_all_v.register_fake
def _(sends, recv_sizes, recv_ndim, group, dims):
    return [sends[0].new_empty(s) for s in _shapes(recv_sizes, recv_ndim)]


def _shapes(sizes: list[int], ndim: int) -> list[tuple[int, ...]]:
    return [tuple(sizes[i:i + ndim]) for i in range(0, len(sizes), ndim)] if ndim else [()] * len(sizes)


_OPS = {"all_gather": _all_gather, "all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter,
        "all_to_all": _all_to_all}


def traced(kind: str, t: torch.Tensor, group: Group, mesh_dim: MeshDims, extra: tuple = ()) -> Any:
    """The traceable form of one collective (``extra``: the reduce op, or broadcast's source)."""
    if kind == "broadcast":
        return _broadcast(t, extra[0], list(group), _dims(mesh_dim))
    return _OPS[kind](t, *extra, list(group), _dims(mesh_dim))


def traced_all_to_all_v(sends: list[torch.Tensor], recv_shapes: list[tuple[int, ...]], group: Group,
                        mesh_dim: MeshDims) -> list[torch.Tensor]:
    """The traceable form of ``all_to_all_v``."""
    ndim = len(recv_shapes[0]) if recv_shapes else 0
    flat = [int(n) for s in recv_shapes for n in s]
    if not ndim:
        flat = [0] * len(recv_shapes)  # scalars: one placeholder per block
    return _all_to_all_v(sends, flat, ndim, list(group), _dims(mesh_dim))
