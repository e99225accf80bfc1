"""``autoshard``: choose a plan for a model on a mesh, and the plan object that applies and explains it."""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from ..mesh import DeviceMesh
from ..redistribute.cost import LinkModel, normalize_links
from .layout import Layout
from .measure import Cost, Device
from .model import Blocks, find_blocks, to_meta
from .report import render
from .solve import Priced, Search, search

__all__ = ["AutoPlan", "autoshard"]


def _mesh_of(mesh: Any) -> tuple[tuple[int, ...], tuple[str, ...], DeviceMesh | None]:
    """``(shape, names, mesh or None)`` from a DeviceMesh, ``((8, 8), ("dp", "tp"))`` or ``(8, 8)``."""
    if isinstance(mesh, DeviceMesh):
        names = tuple(mesh.mesh_dim_names or (f"d{j}" for j in range(mesh.ndim)))
        return tuple(mesh.shape), names, mesh
    if (isinstance(mesh, (tuple, list)) and len(mesh) == 2 and isinstance(mesh[0], (tuple, list))
            and isinstance(mesh[1], (tuple, list))):
        shape, names = tuple(int(k) for k in mesh[0]), tuple(str(n) for n in mesh[1])
    elif isinstance(mesh, (tuple, list)) and all(isinstance(k, int) for k in mesh):
        shape, names = tuple(mesh), tuple(f"d{j}" for j in range(len(mesh)))
    else:
        raise TypeError(f"autoshard: mesh must be a DeviceMesh, a shape such as (8, 8), or (shape, names) such as "
                        f"((8, 8), ('dp', 'tp')); got {mesh!r}")
    if not shape or any(k < 1 for k in shape) or len(names) != len(shape) or len(set(names)) != len(names):
        raise ValueError(f"autoshard: mesh shape {shape} needs positive sizes and one distinct name per dim, got names "
                         f"{names}")
    return shape, names, None


def _mean(out: Any) -> torch.Tensor:
    return out.float().mean()


class AutoPlan:
    """The chosen plan: ``apply(model)``, its predictions, and ``print(plan)`` for the table."""

    def __init__(self, found: Search, blocks: Blocks | None, mesh: DeviceMesh | None, budget: float | None) -> None:
        self.search, self.blocks, self.mesh, self.budget = found, blocks, mesh, budget
        self.layout: Layout = found.best.layout

    @property
    def cost(self) -> Cost:
        return self.search.best.cost

    @property
    def predicted_step_s(self) -> float:
        return self.cost.step_s

    @property
    def predicted_bytes_per_rank(self) -> int:
        """Bytes rank 0 receives in one training step (forward, backward, optimizer step)."""
        return int(round(self.cost.bytes))

    @property
    def memory_per_rank(self) -> int:
        return int(round(self.cost.memory))

    @property
    def solve_s(self) -> float:
        return self.search.seconds

    def apply(self, model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
        """Parallelize ``model`` (built as the planned one was) in place on ``mesh`` and return it."""
        mesh = mesh if mesh is not None else self.mesh
        if mesh is None:
            raise ValueError("plan.apply: this plan was made for a mesh shape; pass the DeviceMesh to apply it on, e.g. "
                             f"init_device_mesh('cuda', {self.layout.mesh_shape}, mesh_dim_names={self.layout.names})")
        return self.layout.apply(model, mesh, self.blocks)

    def __str__(self) -> str:
        return render(self.search, self.blocks, self.budget)

    def __repr__(self) -> str:
        return (f"<AutoPlan {self.layout.roles()}: step {self.predicted_step_s:.4g} s, "
                f"{self.predicted_bytes_per_rank:,} B/rank, {self.memory_per_rank:,} B memory/rank>")

    @property
    def hand(self) -> list[tuple[str, Priced]]:
        return self.search.hand


def autoshard(model: nn.Module, mesh: Any, example_inputs: Any, *, memory_per_rank: float | None = None,
              optimizer: str = "adamw", loss_fn: Callable[[Any], torch.Tensor] | None = None,
              device: Device | None = None, links: LinkModel | Sequence[LinkModel] | None = None) -> AutoPlan:
    """Choose how to shard ``model``'s training on ``mesh``: the plan of least predicted step time
    whose memory per rank fits ``memory_per_rank`` (bytes; None: no limit).

    ``model`` may live on the meta device (nothing is allocated: every plan is priced by one
    training step on meta as rank 0 of a world of shapes).  ``example_inputs``: the global batch
    (a tensor or a tuple of positional inputs).  ``loss_fn(output)``: the scalar the step
    backpropagates (default: the output's mean).  ``optimizer``: ``"adamw"``, ``"adam"``, ``"sgd"`` or
    ``"none"`` (its states count in memory).  ``device`` / ``links``: FLOP/s and memory bandwidth of
    one device, and the alpha-beta link of each mesh dim.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"autoshard: model must be an nn.Module, got {type(model).__name__}")
    shape, names, real = _mesh_of(mesh)
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if memory_per_rank is not None and not memory_per_rank > 0:
        raise ValueError(f"autoshard: memory_per_rank must be a positive number of bytes, got {memory_per_rank!r}")
    blocks = find_blocks(model)
    meta_model = model if all(p.device.type == "meta" for p in model.parameters()) else _meta_copy(model)
    found = search(meta_model, blocks, shape, names, to_meta(inputs), loss_fn or _mean, optimizer,
                   device or Device(), normalize_links(links, len(shape)), memory_per_rank)
    return AutoPlan(found, blocks, real, memory_per_rank)


def _meta_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).to("meta")
