"""One FSDP-managed parameter: its sharded form, its padded local storage and its layout.

See the package docstring for the layout on 1-D and 2-D (dp x tp) meshes.
"""
from __future__ import annotations

import functools
import math
from typing import Any
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..mesh import DeviceMesh, joined_mesh
from ..placement import LAST, Placement, Replicate, Shard, display
from ..spec import DTensorSpec, contiguous_stride
from ..tensor import DTensor

__all__ = ["DataParallelMeshDims", "FSDPParam", "MeshInfo"]


@dataclass(frozen=True)
class DataParallelMeshDims:
    """FSDP2's: which named dims of the full mesh ``fully_shard`` gets are data parallel:
    ``shard`` (FSDP shards parameters over it) and ``replicate`` (HSDP's replicas).  The
    parameters are DTensors on that whole mesh, ``Replicate`` on these dims; each other dim
    keeps its placement (at most one such dim: TP)."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims: at least one of shard and replicate must be set")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(dims: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if dims is None else (dims,) if isinstance(dims, str) else tuple(dims)


@dataclass(frozen=True, eq=False)
class MeshInfo:
    """The mesh ``fully_shard`` got: its shard dim, HSDP's replicate dim, and for the (dp, tp)
    form its tp dim and sub-mesh.  ``spmd``: the mesh is the parameters' own whole mesh
    (``dp_mesh_dims``), so every parameter is a DTensor on it."""

    mesh: DeviceMesh
    dp_dim: int
    rep_dim: int | None = None
    tp_dim: int | None = None
    tp_mesh: DeviceMesh | None = None
    spmd: bool = False

    @staticmethod
    def of(mesh: DeviceMesh, dims: DataParallelMeshDims | None = None) -> "MeshInfo":
        """1-D: FSDP.  2-D: HSDP as in torch (replicate over dim 0, shard over dim 1), except a
        mesh with dims named ``("dp", "tp")``: FSDP on dp with the TP parameters on ``mesh["tp"]``.
        With ``dims``: the dims it names."""
        if dims is not None:
            return MeshInfo._of_dims(mesh, dims)
        if mesh.ndim == 1:
            return MeshInfo(mesh, 0)
        if mesh.ndim != 2:
            raise NotImplementedError(
                f"fully_shard takes a 1-D mesh (FSDP) or a 2-D mesh (HSDP: replicate over dim 0, shard over "
                f"dim 1), got shape {mesh.shape}; for FSDP x TP pass the dp part, e.g. mesh['dp']")
        names = mesh.mesh_dim_names
        if names is not None and "tp" in names:
            if "dp" not in names:
                raise ValueError(f"a 2-D fully_shard mesh with a 'tp' dim needs a 'dp' dim too, got {names}")
            dp = names.index("dp")
            return MeshInfo(mesh, dp, None, 1 - dp, mesh["tp"])
        return MeshInfo(mesh, 1, 0)

    @staticmethod
    def _of_dims(mesh: DeviceMesh, dims: DataParallelMeshDims) -> "MeshInfo":
        if not isinstance(dims, DataParallelMeshDims):
            raise TypeError(f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims, got {type(dims).__name__}")
        names = mesh.mesh_dim_names or ()
        shard, rep = dims.shard_names, dims.replicate_names
        for n in shard + rep:
            if n not in names:
                raise ValueError(f"fully_shard: dp_mesh_dims names {n!r}, which is not a dim of the mesh {names}")
        if len(shard) != 1 or len(rep) > 1:
            raise NotImplementedError(f"fully_shard: dp_mesh_dims={dims} (FSDP over several mesh dims at once, or "
                                      "replicas only) is not supported; name one shard dim and at most one "
                                      "replicate dim, or flatten them first (mesh['a', 'b']._flatten('ab'))")
        others = [n for n in names if n not in shard + rep]
        if len(others) > 1 or (others and rep):
            raise NotImplementedError(f"fully_shard: dp_mesh_dims on a mesh {names} with the other dims {others} "
                                      f"{'and replicas ' if rep else ''}is not supported; at most one other dim (TP)")
        tp = names.index(others[0]) if others else None
        return MeshInfo(mesh, names.index(shard[0]), names.index(rep[0]) if rep else None, tp,
                        mesh[others[0]] if others else None, spmd=True)

    @property
    def dp_dims(self) -> tuple[int, ...]:
        """The mesh dims data parallelism uses (shard, and HSDP's replicate dim)."""
        return (self.dp_dim,) if self.rep_dim is None else (self.dp_dim, self.rep_dim)

    @functools.cached_property
    def world(self) -> int:  # read per hook call; a mesh's sizes never change
        return self.mesh.size(self.dp_dim)

    @functools.cached_property
    def replicas(self) -> int:
        return 1 if self.rep_dim is None else self.mesh.size(self.rep_dim)

    @property
    def rank(self) -> int:
        coord = self.mesh.get_coordinate()
        if coord is None:
            raise RuntimeError(f"rank {self.mesh.get_rank()} is not in the FSDP mesh {self.mesh}")
        return coord[self.dp_dim]


class FSDPParam:
    """A parameter sharded along dim 0 over the dp mesh dim: ``Shard(0)`` (torch.chunk rule,
    uneven allowed) or ``RaggedShard(0, units)`` (per-rank pieces of chosen sizes).

    ``Shard(0)``: ``padded`` holds this rank's ``c = ceil(s / W)`` rows (``s`` = dim 0 of the
    unsharded tensor the forward uses: the whole parameter, or its TP-local piece on a 2-D
    mesh); the sharded parameter's local tensor is its first ``rows`` rows, the rest stays
    zero.  The all-gather sends the whole padded block, so every rank's slot has the same size.
    ``RaggedShard(0, ...)``: ``padded`` is exactly this rank's piece (``c = rows``); the group
    packs every rank's ragged pieces end to end after the even ones (``packing.py``).
    """

    def __init__(self, param: nn.Parameter, owners: list[tuple[nn.Module, str]], info: MeshInfo,
                 placement: Placement | None = None) -> None:
        self.owners = owners
        self.info = info
        self.orig_id = id(param)
        self.orig_dtype = param.dtype
        self.requires_grad = param.requires_grad
        self.accumulated: torch.Tensor | None = None  # unsharded local gradients of unsynchronized backwards
        self.tp_spec: DTensorSpec | None = None
        if isinstance(param, DTensor):
            self.tp_spec = DTensorSpec.build(param.device_mesh, param.placements, param.shape, None, param.dtype)
            unsharded = param._local_tensor.detach()
        else:
            unsharded = param.detach()
        global_shape = tuple(param.shape)
        if unsharded.ndim == 0:
            raise ValueError(f"fully_shard cannot shard the 0-d parameter {self.fqn}; make it 1-d (shape (1,))")
        self.unsharded_shape = tuple(unsharded.shape)
        self.unsharded_stride = contiguous_stride(self.unsharded_shape)
        W, r = info.world, info.rank
        s = self.unsharded_shape[0]
        self.rest = self.unsharded_shape[1:]
        self.row_numel = math.prod(self.rest)
        self.dp_placement = self._dp_placement(placement, W)
        self.ragged = not self.dp_placement.is_shard(0)
        # (rows, first row) of every dp rank's piece of dim 0
        self.runs = [self.dp_placement.pieces(s, W, q)[0] for q in range(W)]
        self.rows, off = self.runs[r]
        self.c = self.rows if self.ragged else -(-s // W) if s else 0
        self.padded_numel = self.c * self.row_numel
        self.numel = s * self.row_numel
        self.padded = torch.zeros((self.c, *self.rest), dtype=unsharded.dtype, device=unsharded.device)
        self.padded[: self.rows].copy_(unsharded[off: off + self.rows])
        mesh, dp, tp, tp_pl = self._layout(param, info)
        placements: list[Placement] = [Replicate()] * mesh.ndim
        placements[dp] = self.dp_placement
        order = None
        if tp is not None:
            assert tp_pl is not None
            placements[tp] = tp_pl
            if tp_pl == Shard(0):
                order = ((0, (tp, dp)),)
        self.spec = DTensorSpec.build(mesh, placements, global_shape, None, param.dtype, order)
        local = self.padded.narrow(0, 0, self.rows)
        if self.spec.local_shape != tuple(local.shape):
            raise AssertionError(f"FSDP layout of {self.fqn}: spec {self.spec} gives local shape "
                                 f"{self.spec.local_shape}, the padded shard has {tuple(local.shape)}")
        self.sharded: Any = nn.Parameter(DTensor(local, self.spec), requires_grad=param.requires_grad)
        self._point_at_padded()

    @property
    def fqn(self) -> str:
        mod, name = self.owners[0]
        return f"{type(mod).__name__}.{name}"

    def _layout(self, param: Any, info: MeshInfo) -> tuple[DeviceMesh, int, int | None, Placement | None]:
        """The sharded parameter's mesh, its dp dim, its tp dim and TP placement (None: no TP).

        A plain parameter lives on the FSDP mesh.  A DTensor parameter on a 1-D TP mesh lives on
        the FSDP mesh's dims plus the TP mesh's, cut from the mesh both came from (torch's 2-D
        recipe); on the ("dp", "tp") form, on that mesh.
        """
        pl = param.placements if isinstance(param, DTensor) else None
        on_mesh = pl is not None and param.device_mesh == info.mesh
        if info.spmd and not on_mesh:
            raise ValueError(f"fully_shard with dp_mesh_dims: parameter {self.fqn} must be a DTensor on the mesh "
                             f"{info.mesh} (e.g. from distribute_module), got "
                             f"{'a plain tensor' if pl is None else param.device_mesh}")
        # a DTensor on the FSDP mesh itself: dp_mesh_dims, or the (dp, tp) form
        if pl is not None and on_mesh and (info.spmd or info.tp_dim is not None):
            if any(not pl[d].is_replicate() for d in info.dp_dims):
                raise ValueError(f"fully_shard: parameter {self.fqn} on the FSDP mesh is {display(pl)}; it must be "
                                 "Replicate on the data-parallel dims")
            tp_pl = None if info.tp_dim is None else self._tp_placement(pl[info.tp_dim])
            return info.mesh, info.dp_dim, info.tp_dim, tp_pl
        if info.tp_dim is not None:  # the (dp, tp) form
            if pl is None:
                return info.mesh, info.dp_dim, info.tp_dim, Replicate()
            if param.device_mesh == info.tp_mesh:
                tp_pl = pl[0]
            else:
                raise ValueError(f"fully_shard: parameter {self.fqn} on {param.device_mesh} is neither on the FSDP "
                                 f"mesh {info.mesh} nor on its tp sub-mesh {info.tp_mesh}")
            return info.mesh, info.dp_dim, info.tp_dim, self._tp_placement(tp_pl)
        if pl is None:
            return info.mesh, info.dp_dim, None, None
        tp_mesh = param.device_mesh
        joined = joined_mesh(info.mesh, tp_mesh) if tp_mesh.ndim == 1 else None
        if joined is None:
            raise ValueError(
                f"fully_shard: parameter {self.fqn} is a DTensor on {tp_mesh} {display(pl)}, which is not a 1-D mesh "
                f"cut from the same parent mesh as the FSDP mesh {info.mesh}; build both from one mesh, as in "
                "parallelize_module(m, mesh['tp'], plan) then fully_shard(m, mesh=mesh['dp'])")
        return joined, info.dp_dim, info.mesh.ndim, self._tp_placement(pl[0])

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        """The shape of the unsharded buffer the all-gather fills: every rank's padded block
        (``W * c`` rows, a prefix of which is the parameter), or the parameter itself (ragged)."""
        return self.unsharded_shape if self.ragged else (self.info.world * self.c, *self.rest)

    def _dp_placement(self, p: Placement | None, world: int) -> Placement:
        """``shard_placement_fn``'s answer checked: None is ``Shard(0)``; else a placement of dim 0
        with one piece per dp rank (``Shard(0)``, ``RaggedShard(0, units)``)."""
        if p is None:
            return Shard(0)
        if not isinstance(p, Placement):
            raise TypeError(f"fully_shard: shard_placement_fn gives {p!r} for {self.fqn}; return a placement "
                            "(Shard(0), RaggedShard(0, local_units)) or None")
        try:
            p = p.normalized(len(self.unsharded_shape), world)  # dims wrapped; the number of pieces checked
        except ValueError as e:
            raise ValueError(f"fully_shard: shard_placement_fn's placement for {self.fqn}: {e}") from None
        if p.tensor_dim() != 0:
            raise NotImplementedError(f"fully_shard: shard_placement_fn gives {p!r} for {self.fqn}; FSDP shards dim 0: "
                                      "return Shard(0) or RaggedShard(0, local_units) (or None)")
        s, at = self.unsharded_shape[0], 0
        for q in range(world):  # FSDP packs one run per rank, the runs in rank order making the dim
            runs = p.pieces(s, world, q)
            if len(runs) != 1 or runs[0][1] != at:
                raise NotImplementedError(f"fully_shard: shard_placement_fn gives {p!r} for {self.fqn}, whose pieces "
                                          "are not one run per rank in rank order; use Shard(0) or "
                                          "RaggedShard(0, local_units)")
            at += runs[0][0]
        return p

    def _tp_placement(self, p: Placement) -> Placement:
        if p.is_partial():
            raise ValueError(f"fully_shard: parameter {self.fqn} cannot be {p!r} on the tp mesh dim")
        if p.nests == LAST and p.tensor_dim() == 0:  # FSDP splits dim 0 of the packed pieces: no such layout
            raise NotImplementedError(f"fully_shard: parameter {self.fqn} is packed on dim 0 ({p!r}) on the tp mesh "
                                      "dim; FSDP shards dim 0 too. Pack another dim, or redistribute it to Shard(0)")
        return p

    def sync_padded(self) -> None:
        """Re-point the sharded parameter at ``padded`` if something replaced its local tensor."""
        local = self.sharded._local_tensor
        if local is self._local and local.data_ptr() == self._local_ptr:  # the one this object set (hot path)
            return
        if local.untyped_storage().data_ptr() == self.padded.untyped_storage().data_ptr() and \
                local.data_ptr() == self.padded.data_ptr() and tuple(local.shape) == (self.rows, *self.rest):
            return
        with torch.no_grad():
            self.padded[: self.rows].copy_(local)
        self._point_at_padded()

    def adopt_local(self) -> bool:
        """Follow a local tensor that ``nn.Module._apply`` (``to_empty``, ``to``, ``cuda``) put on
        another device or dtype: ``padded`` is rebuilt there (a model built on the meta device
        gets its memory here).  True if it was rebuilt."""
        local = self.sharded._local_tensor
        moved = local.device != self.padded.device or local.dtype != self.padded.dtype
        if moved:
            self.padded = torch.zeros((self.c, *self.rest), dtype=local.dtype, device=local.device)
        if local.dtype != self.orig_dtype:
            self.orig_dtype = local.dtype
            self.spec = self.spec.with_dtype(local.dtype)
            self.tp_spec = self.tp_spec.with_dtype(local.dtype) if self.tp_spec is not None else None
        self.sync_padded()  # copies the local tensor into ``padded`` and points the parameter at it
        return moved

    def _point_at_padded(self) -> None:
        local = self.sharded._local_tensor = self.padded.narrow(0, 0, self.rows)
        self._local, self._local_ptr = local, local.data_ptr()

    def wrap_grad(self, local: torch.Tensor) -> DTensor:
        return DTensor(local, self.spec)

    def unsharded_view(self, full_padded: torch.Tensor) -> torch.Tensor:
        """The unsharded parameter the forward uses: a plain tensor, or a DTensor on the tp mesh.

        Its first ``unsharded_shape[0]`` rows (``full_padded`` is contiguous), by ``as_strided``:
        one forward makes a view per parameter, and ``narrow`` costs about twice as much."""
        t = full_padded.as_strided(self.unsharded_shape, self.unsharded_stride, full_padded.storage_offset())
        if self.tp_spec is None:
            return t
        return DTensor(t, self.tp_spec.with_dtype(t.dtype))
