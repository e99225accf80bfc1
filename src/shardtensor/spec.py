"""DTensorSpec: everything that describes a sharded tensor except its data."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from .mesh import DeviceMesh
from .placement import (Placement, ShardOrder, all_planned, default_shard_order, display, local_shape_and_offset,
                        normalize_placements, unpartial, validate_shard_order)


@dataclass(frozen=True, eq=False)
class DTensorSpec:
    """Mesh + placements + shard order + global shape, stride and dtype (immutable, hashable)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    shard_order: ShardOrder = field(default=())
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    _locals: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """Local shape and offset per mesh coordinate, computed once (views and factories ask per call)."""
    _default_order: bool = field(default=True, init=False, repr=False, compare=False)
    opaque: bool = field(default=False, init=False, repr=False, compare=False)
    """Whether a placement is one the sharding rules do not read (dispatch gathers it first:
    ``dispatch/opaque.py``)."""
    planned: bool = field(default=True, init=False, repr=False, compare=False)
    """Whether the collective planner moves every placement (else redistribution exchanges blocks)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "opaque", not all(p.rules_read for p in self.placements))
        object.__setattr__(self, "planned", all_planned(self.placements))
        object.__setattr__(self, "_hash", hash((self.mesh, self.placements, tuple(self.shape), self.stride, self.dtype,
                                                self.shard_order)))
        object.__setattr__(self, "_default_order", self.shard_order == default_shard_order(self.placements))

    def __hash__(self) -> int:
        return self._hash

    def __deepcopy__(self, memo: dict) -> "DTensorSpec":  # immutable (torch.compile copies guard metadata)
        return self

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DTensorSpec) or self._hash != other._hash:
            return False
        return (self.placements == other.placements and self.shape == other.shape and self.stride == other.stride
                and self.dtype == other.dtype and self.shard_order == other.shard_order and self.mesh == other.mesh)

    @staticmethod
    def build(mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int], stride: Sequence[int] | None,
              dtype: torch.dtype, shard_order: ShardOrder | None = None) -> "DTensorSpec":
        """Validated spec; the shard order defaults to mesh dims left to right.  Equal arguments
        give the same (interned) spec, so caches keyed by a spec's identity hit across calls."""
        if shard_order is None:  # a DTensor's OrderedPlacements passed back carries its order
            shard_order = getattr(placements, "shard_order", None)
        try:
            key: tuple | None = (mesh, tuple(placements), tuple(shape), None if stride is None else tuple(stride),
                                 dtype, shard_order)
            spec = _BUILT.get(key)  # type: ignore[arg-type]
        except TypeError:  # unhashable arguments: the checks below say what is wrong
            key = spec = None
            # torch.compile's symbolic sizes (a DTensor view replayed on fake tensors): specialized,
            # one guard per dim, since a spec holds the sizes every rank's plan is worked out from
            shape = [int(n) if isinstance(n, torch.SymInt) else n for n in shape]
            stride = None if stride is None else [int(n) if isinstance(n, torch.SymInt) else n for n in stride]
        if spec is not None:
            return spec
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"device_mesh must be a DeviceMesh, got {mesh!r}")
        shape = torch.Size(shape)
        pl = normalize_placements(placements, len(shape), mesh.ndim, mesh.shape)
        order = default_shard_order(pl) if shard_order is None else validate_shard_order(pl, shard_order)
        if stride is None:
            stride = contiguous_stride(shape)
        spec = interned(DTensorSpec(mesh, pl, shape, tuple(stride), dtype, order))
        if key is not None:
            if len(_BUILT) >= _MAX_INTERNED:
                _BUILT.clear()
            _BUILT[key] = spec
        return spec

    def with_placements(self, placements: Sequence[Placement], shard_order: ShardOrder | None = None) -> "DTensorSpec":
        """This spec with other placements (and shard order: default where ``None``); itself where
        they are its own (what ``build`` would return, without building the key)."""
        if shard_order is None:  # a DTensor's OrderedPlacements passed back carries its order
            shard_order = getattr(placements, "shard_order", None)
        if isinstance(placements, tuple) and placements == self.placements and (
                self.is_default_order if shard_order is None else shard_order == self.shard_order):
            return self
        return DTensorSpec.build(self.mesh, placements, self.shape, self.stride, self.dtype, shard_order)

    def unpartial(self) -> "DTensorSpec":
        """This spec with every Partial reduced to Replicate (itself when none is Partial)."""
        if not any(p.is_partial() for p in self.placements):
            return self
        return self.with_placements(unpartial(self.placements), self.shard_order)

    def with_dtype(self, dtype: torch.dtype) -> "DTensorSpec":
        return self if dtype == self.dtype else interned(replace(self, dtype=dtype))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_default_order(self) -> bool:
        return self._default_order

    def local_shape_and_offset(self, coordinate: Sequence[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Local shape and global offset of this rank (or of ``coordinate``)."""
        coord = self.mesh._coord if coordinate is None else tuple(coordinate)
        r = self._locals.get(coord)
        if r is None:
            r = self._locals[coord] = local_shape_and_offset(self.shape, self.mesh.shape, coord, self.placements,
                                                             self.shard_order)
        return r

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.local_shape_and_offset()[0]

    def __repr__(self) -> str:
        return f"DTensorSpec({display(self.placements, self.shard_order)}, shape={tuple(self.shape)}, {self.dtype})"


def compute_local_shape_and_global_offset(global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement],
                                          skip_offset: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shape and global offset on ``mesh`` (torch's helper of the same name,
    which reads only its own placement classes); a rank off the mesh gets ``((0,), ())``."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a shardtensor DeviceMesh, got {type(mesh).__name__}")
    pl = normalize_placements(placements, len(global_shape), mesh.ndim, mesh.shape)
    order = getattr(placements, "shard_order", None)
    shape, offset = local_shape_and_offset(tuple(global_shape), mesh.shape, mesh._coord, pl, order)
    return shape, (() if skip_offset else offset)


_MAX_INTERNED = 4096
_BUILT: dict[tuple, DTensorSpec] = {}  # build's arguments -> the spec
_BY_VALUE: dict[DTensorSpec, DTensorSpec] = {}


def interned(spec: DTensorSpec) -> DTensorSpec:
    """The one spec equal to ``spec`` (itself when first seen): the dispatcher's hit path keys a
    call by its specs' identities, so a spec rebuilt each step (``from_local``, a redistribute's
    target) must come back as the same object to hit.  Bounded: full tables start afresh."""
    got = _BY_VALUE.get(spec)
    if got is None:
        if len(_BY_VALUE) >= _MAX_INTERNED:
            _BY_VALUE.clear()
        got = _BY_VALUE[spec] = spec
    return got


def same_local(have: DTensorSpec, want: DTensorSpec) -> bool:
    """Whether every rank's local tensor is the same under ``have`` and ``want``: they differ at
    most on mesh dims of size one (a shard, a replica and a partial term of one rank are all the
    whole value).  Propagation then runs an op on its inputs as they are (and the dispatcher may
    cache the decision), and redistributing between them moves nothing."""
    if have is want:
        return True
    if have.shape != want.shape or have.stride != want.stride or have.dtype != want.dtype or have.mesh != want.mesh:
        return False
    return _effective(have) == _effective(want)


def _effective(spec: DTensorSpec) -> tuple:
    """The placements and shard order of ``spec`` on the mesh dims with more than one rank."""
    ks = spec.mesh.shape
    pl = tuple(p if ks[j] > 1 else None for j, p in enumerate(spec.placements))
    order = tuple((d, kept) for d, js in spec.shard_order if (kept := tuple(j for j in js if ks[j] > 1)))
    return pl, order


def placements_text(specs: Sequence["DTensorSpec | None"]) -> str:
    """The input placements of an op as errors and warnings print them: ``(S(0)), (R, P(sum))``."""
    return ", ".join(display(s.placements, s.shard_order) for s in specs if s is not None)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))
