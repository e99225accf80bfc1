"""The plans auto-sharding chooses among, and how one is applied through the public API.

A plan gives every mesh dim a role -- it splits the batch, or (at most one dim) it carries tensor
parallelism -- and each *unit* (the repeated blocks, all alike; the root) an FSDP layout over the
batch dims: sharded over all of them (``full``) or, with two batch dims, replicated over the first
and sharded over the second (``hybrid``, HSDP), and whether parameters are freed after forward
(``reshard``).  With a TP dim, the blocks' Linears take the styles propagation implied
(``model.infer_tp_plan``) and the root's Linears optionally go column-wise with a replicated
output (``root_tp``).

The output is the global DTensor, so a loss on it is the global loss and each rank's gradients are
its share of the global gradient: FSDP sums them over the batch ranks
(``set_gradient_divide_factor(1.0)``) instead of averaging per-rank losses' gradients.

``apply`` writes what a user would have written: ``parallelize_module`` with those styles on
``mesh[tp]``, then ``fully_shard`` on every block and on the root, and two hooks on the root: the
input hook gives each rank its rows of the plain global batch (the rows ``output_placements`` give
it), the output hook returns the global
output as a DTensor (``Shard(0)`` over the batch dims, replicated over the TP dim).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..fsdp import fully_shard
from ..mesh import DeviceMesh
from ..parallel import ColwiseParallel, ParallelStyle, parallelize_module
from ..placement import Placement, Replicate, Shard
from ..spec import compute_local_shape_and_global_offset
from ..tensor import DTensor
from .model import STYLES, Blocks

__all__ = ["Unit", "Layout"]


@dataclass(frozen=True)
class Unit:
    """One unit's FSDP layout: ``shard`` is ``"full"``, ``"hybrid"`` or ``"none"`` (no batch dim)."""

    shard: str = "full"
    reshard: bool = True

    def label(self) -> str:
        if self.shard == "none":
            return "-"
        return ("HSDP" if self.shard == "hybrid" else "FSDP") + ("" if self.reshard else " keep")


@dataclass(frozen=True)
class Layout:
    """A whole plan: mesh, roles, one ``Unit`` for the blocks and one for the root, TP styles."""

    mesh_shape: tuple[int, ...]
    names: tuple[str, ...]
    tp: int | None
    blocks: Unit
    root: Unit
    root_tp: bool = False
    tp_plan: tuple[tuple[str, str], ...] = field(default=())

    @property
    def batch_dims(self) -> tuple[int, ...]:
        return tuple(j for j in range(len(self.mesh_shape)) if j != self.tp)

    def roles(self) -> str:
        return ", ".join(f"{self.names[j]}={self.mesh_shape[j]}:{'tp' if j == self.tp else 'batch'}"
                         for j in range(len(self.mesh_shape)))

    def output_placements(self) -> tuple[Placement, ...]:
        return tuple(Replicate() if j == self.tp else Shard(0) for j in range(len(self.mesh_shape)))

    def _dp_mesh(self, mesh: DeviceMesh, unit: Unit) -> DeviceMesh:
        names = tuple(self.names[j] for j in self.batch_dims)
        if len(names) == 1:
            return mesh[names[0]]
        sub = mesh[names]
        if unit.shard == "hybrid":
            return sub
        return sub._flatten("_".join(names))

    def apply(self, model: nn.Module, mesh: DeviceMesh, blocks: Blocks | None, *,
              src_data_rank: int | None = 0) -> nn.Module:
        """Parallelize ``model`` in place as this plan says (see the module docstring)."""
        if tuple(mesh.shape) != self.mesh_shape:
            raise ValueError(f"plan.apply: the plan is for a mesh of shape {self.mesh_shape}, got {tuple(mesh.shape)}")
        units = list(blocks.of(model)) if blocks is not None else []
        if self.tp is not None:
            tp_mesh = mesh[self.names[self.tp]]
            styles = {n: STYLES[s]() for n, s in self.tp_plan}
            for blk in units:
                parallelize_module(blk, tp_mesh, styles, src_data_rank=src_data_rank)
            if self.root_tp:
                inside = {id(m) for u in units for m in u.modules()}
                heads: dict[str, ParallelStyle] = {
                    n: ColwiseParallel(output_layouts=Replicate()) for n, m in model.named_modules()
                    if isinstance(m, nn.Linear) and id(m) not in inside}
                parallelize_module(model, tp_mesh, heads, src_data_rank=src_data_rank)
        if self.batch_dims:
            for blk in units:
                fully_shard(blk, mesh=self._dp_mesh(mesh, self.blocks), reshard_after_forward=self.blocks.reshard)
                blk.set_gradient_divide_factor(1.0)  # type: ignore[operator]
            fully_shard(model, mesh=self._dp_mesh(mesh, self.root), reshard_after_forward=self.root.reshard)
            model.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # the loss is global: sum, don't average
        split = _SplitBatch(self, mesh)
        model.register_forward_pre_hook(split, with_kwargs=True, prepend=True)
        model.register_forward_hook(_GlobalOutput(split))
        return model


class _SplitBatch:
    """Forward pre-hook: each rank keeps its rows of the batch -- the first tensor input, and every other
    tensor input with as many rows (others pass whole) -- the rows the output's placements give it,
    so the pieces and the global output agree for any batch size."""

    def __init__(self, layout: Layout, mesh: DeviceMesh) -> None:
        self.mesh, self.layout = mesh, layout
        self.rows = self.start = self.count = 0

    def _split(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.ndim > 0 and x.shape[0] == self.rows:
            return x.narrow(0, self.start, self.count)
        return x

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.ndim > 0), None)
        if first is None or isinstance(first, DTensor):
            raise TypeError(f"plan.apply: the model's first tensor input must be the plain global batch (dim 0 the "
                            f"batch), got {type(first).__name__}")
        self.rows = first.shape[0]
        (self.count,), (self.start,) = compute_local_shape_and_global_offset(
            (self.rows,), self.mesh, self.layout.output_placements())
        return tuple(self._split(a) for a in args), {k: self._split(v) for k, v in kwargs.items()}


class _GlobalOutput:
    """Forward hook: the root's output, this rank's rows, as the global DTensor."""

    def __init__(self, split: _SplitBatch) -> None:
        self.split = split

    def __call__(self, module: nn.Module, args: tuple, out: Any) -> Any:
        if not isinstance(out, torch.Tensor):
            return out
        local = out.to_local() if isinstance(out, DTensor) else out
        s = self.split
        return DTensor.from_local(local, s.mesh, s.layout.output_placements(), shape=(s.rows, *local.shape[1:]))
