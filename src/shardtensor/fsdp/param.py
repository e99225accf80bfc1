"""One FSDP-managed parameter: its sharded form, its padded local storage and its layout.

See the package docstring for the layout on 1-D and 2-D (dp x tp) meshes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..mesh import DeviceMesh
from ..placement import Partial, Placement, Replicate, Shard, chunk, display
from ..spec import DTensorSpec
from ..tensor import DTensor

__all__ = ["FSDPParam", "MeshInfo"]


@dataclass(frozen=True, eq=False)
class MeshInfo:
    """The mesh sharded parameters live on, its data-parallel dim and (2-D) its tp dim."""

    mesh: DeviceMesh
    dp_dim: int
    tp_dim: int | None
    tp_mesh: DeviceMesh | None

    @staticmethod
    def of(mesh: DeviceMesh) -> "MeshInfo":
        if mesh.ndim == 1:
            return MeshInfo(mesh, 0, None, None)
        if mesh.ndim != 2:
            raise NotImplementedError(f"fully_shard supports 1-D (dp) and 2-D (dp, tp) meshes, got shape {mesh.shape}")
        names = mesh.mesh_dim_names
        if names is not None and ("dp" in names) != ("tp" in names):
            raise ValueError(f"a 2-D fully_shard mesh needs dims named ('dp', 'tp') (or unnamed dims, dp first), "
                             f"got {names}")
        dp = names.index("dp") if names is not None and "dp" in names else 0
        tp = 1 - dp
        return MeshInfo(mesh, dp, tp, mesh[names[tp] if names is not None and "tp" in names else tp])

    @property
    def world(self) -> int:
        return self.mesh.size(self.dp_dim)

    @property
    def rank(self) -> int:
        coord = self.mesh.get_coordinate()
        if coord is None:
            raise RuntimeError(f"rank {self.mesh.get_rank()} is not in the FSDP mesh {self.mesh}")
        return coord[self.dp_dim]


class FSDPParam:
    """A parameter sharded along dim 0 over the dp mesh dim (torch.chunk rule, uneven allowed).

    ``padded`` holds this rank's ``c = ceil(s / W)`` rows (``s`` = dim 0 of the unsharded
    tensor the forward uses: the whole parameter, or its TP-local piece on a 2-D mesh); the
    sharded parameter's local tensor is its first ``rows`` rows, the rest stays zero.  The
    all-gather sends the whole padded block, so every rank's slot has the same size.
    """

    def __init__(self, param: nn.Parameter, owners: list[tuple[nn.Module, str]], info: MeshInfo) -> None:
        self.owners = owners
        self.info = info
        self.orig_id = id(param)
        self.orig_dtype = param.dtype
        self.requires_grad = param.requires_grad
        self.tp_spec: DTensorSpec | None = None
        tp_pl: Placement | None = None
        if isinstance(param, DTensor):
            self.tp_spec, tp_pl = self._tp_spec_of(param, info)
            unsharded = param._local_tensor.detach()
            global_shape = tuple(param.shape)
        else:
            if info.tp_dim is not None:
                tp_pl = Replicate()
            unsharded = param.detach()
            global_shape = tuple(param.shape)
        if unsharded.ndim == 0:
            raise ValueError(f"fully_shard cannot shard the 0-d parameter {self.fqn}; make it 1-d (shape (1,))")
        self.unsharded_shape = tuple(unsharded.shape)
        W, r = info.world, info.rank
        s = self.unsharded_shape[0]
        self.rest = self.unsharded_shape[1:]
        self.row_numel = math.prod(self.rest)
        self.c = -(-s // W) if s else 0
        self.rows, off = chunk(s, W, r)
        self.padded_numel = self.c * self.row_numel
        self.padded = torch.zeros((self.c, *self.rest), dtype=unsharded.dtype, device=unsharded.device)
        self.padded[: self.rows].copy_(unsharded[off: off + self.rows])
        placements: list[Placement] = [Shard(0)] * info.mesh.ndim
        order = None
        if info.tp_dim is not None:
            placements[info.tp_dim] = tp_pl
            if tp_pl == Shard(0):
                order = ((0, (info.tp_dim, info.dp_dim)),)
        self.spec = DTensorSpec.build(info.mesh, placements, global_shape, None, param.dtype, order)
        local = self.padded.narrow(0, 0, self.rows)
        if self.spec.local_shape != tuple(local.shape):
            raise AssertionError(f"FSDP layout of {self.fqn}: spec {self.spec} gives local shape "
                                 f"{self.spec.local_shape}, the padded shard has {tuple(local.shape)}")
        self.sharded = nn.Parameter(DTensor(local, self.spec), requires_grad=param.requires_grad)
        self.sharded._local_tensor = local

    @property
    def fqn(self) -> str:
        mod, name = self.owners[0]
        return f"{type(mod).__name__}.{name}"

    @staticmethod
    def _tp_spec_of(param: DTensor, info: MeshInfo) -> tuple[DTensorSpec, Placement]:
        """The spec the forward sees (the parameter's own: on ``mesh['tp']`` or on the 2-D mesh
        with Replicate on dp) and the TP placement."""
        if info.tp_dim is None:
            raise NotImplementedError(
                f"fully_shard on the 1-D mesh {info.mesh} got a parameter that is already a DTensor on "
                f"{param.device_mesh} {display(param.placements)}; for FSDP x TP pass the 2-D (dp, tp) mesh")
        pl = param.placements
        if param.device_mesh == info.mesh:
            if not isinstance(pl[info.dp_dim], Replicate):
                raise ValueError(f"fully_shard: a parameter on the 2-D mesh must be Replicate on the dp dim, "
                                 f"got {display(pl)}")
            tp_pl = pl[info.tp_dim]
        elif param.device_mesh == info.tp_mesh:
            tp_pl = pl[0]
        else:
            raise ValueError(f"fully_shard: parameter on {param.device_mesh} is neither on the FSDP mesh {info.mesh} "
                             f"nor on its tp sub-mesh {info.tp_mesh}")
        if isinstance(tp_pl, Partial):
            raise ValueError(f"fully_shard: a parameter cannot be {tp_pl!r} on the tp mesh dim")
        spec = DTensorSpec.build(param.device_mesh, pl, param.shape, None, param.dtype)
        return spec, tp_pl

    def sync_padded(self) -> None:
        """Re-point the sharded parameter at ``padded`` if something replaced its local tensor."""
        local = self.sharded._local_tensor
        if local.untyped_storage().data_ptr() == self.padded.untyped_storage().data_ptr() and \
                local.data_ptr() == self.padded.data_ptr() and tuple(local.shape) == (self.rows, *self.rest):
            return
        with torch.no_grad():
            self.padded[: self.rows].copy_(local)
        self.sharded._local_tensor = self.padded.narrow(0, 0, self.rows)

    def wrap_grad(self, local: torch.Tensor) -> DTensor:
        return DTensor(local, self.spec)

    def unsharded_view(self, full_padded: torch.Tensor) -> torch.Tensor:
        """The unsharded parameter the forward uses: a plain tensor, or a DTensor on the tp mesh."""
        t = full_padded.narrow(0, 0, self.unsharded_shape[0])
        if self.tp_spec is None:
            return t
        return DTensor(t, self.tp_spec.with_dtype(t.dtype))
