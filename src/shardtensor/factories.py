"""DTensor factories: ``zeros``, ``ones``, ``empty``, ``full``, ``rand``, ``randn``, as in
``torch.distributed.tensor``, with ``device_mesh=`` and ``placements=``.

Each rank allocates only its block.  ``rand``/``randn`` fill it through the random rule, so
after ``torch.manual_seed(s)`` they equal ``torch.rand``/``torch.randn`` on one device with
seed ``s``, sliced (see :mod:`shardtensor.rng`).  A ``Partial`` placement holds terms that
reduce to the value exactly (the value on coordinate 0, the identity elsewhere).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .mesh import DeviceMesh, resolve_mesh
from .placement import Placement, Replicate
from .spec import DTensorSpec
from .submesh import empty_local
from .tensor import DTensor

__all__ = ["zeros", "ones", "empty", "full", "rand", "randn"]


def _sizes(who: str, size: tuple[Any, ...]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in size):
        raise ValueError(f"shardtensor.{who}: size must be non-negative ints (or one sequence of them), got {size!r}")
    return tuple(size)


def _make(who: str, size: tuple[int, ...], fill: Any, *, dtype: torch.dtype | None, layout: torch.layout,
          requires_grad: bool, device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None) -> Any:
    """The DTensor of ``size`` whose blocks are ``fill(local)`` (``fill`` None: uninitialized)."""
    if layout != torch.strided:
        raise ValueError(f"shardtensor.{who}: layout must be torch.strided, got {layout}")
    mesh = resolve_mesh(device_mesh, f"shardtensor.{who}")
    placements = tuple(placements) if placements is not None else (Replicate(),) * mesh.ndim
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    spec = DTensorSpec.build(mesh, placements, size, None, dtype)
    whole = spec.unpartial()
    if mesh.get_coordinate() is None:
        local = empty_local(whole, mesh.device)
    else:
        local = torch.empty(whole.local_shape_and_offset()[0], dtype=dtype, device=mesh.device)
    out = DTensor(local, whole)
    if fill is not None:
        with torch.no_grad():
            fill(out)
    coord = mesh.get_coordinate()
    if whole != spec:  # terms that reduce back to the value exactly, no collective
        local = out.to_local()
        for j, p in enumerate(spec.placements):
            if p.is_partial() and coord is not None:
                local = p.split_value(local, mesh.shape[j], coord[j])
        out = DTensor(local, spec)
    return out.requires_grad_(requires_grad)


def zeros(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of zeros."""
    return _make("zeros", _sizes("zeros", size), lambda t: t.zero_(), dtype=dtype, layout=layout,
                 requires_grad=requires_grad, device_mesh=device_mesh, placements=placements)


def ones(*size: Any, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided, requires_grad: bool = False,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of ones."""
    return _make("ones", _sizes("ones", size), lambda t: t.fill_(1), dtype=dtype, layout=layout,
                 requires_grad=requires_grad, device_mesh=device_mesh, placements=placements)


def empty(*size: Any, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided, requires_grad: bool = False,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """An uninitialized DTensor."""
    return _make("empty", _sizes("empty", size), None, dtype=dtype, layout=layout,
                 requires_grad=requires_grad, device_mesh=device_mesh, placements=placements)


def full(size: Sequence[int], fill_value: Any, *, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         requires_grad: bool = False, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor filled with ``fill_value`` (its dtype inferred as ``torch.full`` infers it)."""
    if dtype is None:
        dtype = torch.full((), fill_value).dtype
    return _make("full", _sizes("full", (size,)), lambda t: t.fill_(fill_value), dtype=dtype, layout=layout,
                 requires_grad=requires_grad, device_mesh=device_mesh, placements=placements)


def rand(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """Uniform [0, 1) values: one device's ``torch.rand`` from the same generator state, sliced."""
    return _make("rand", _sizes("rand", size), lambda t: t.uniform_(), dtype=dtype, layout=layout,
                 requires_grad=requires_grad, device_mesh=device_mesh, placements=placements)


def randn(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """Standard normal values: one device's ``torch.randn`` from the same generator state, sliced."""
    return _make("randn", _sizes("randn", size), lambda t: t.normal_(), dtype=dtype, layout=layout,
                 requires_grad=requires_grad, device_mesh=device_mesh, placements=placements)
