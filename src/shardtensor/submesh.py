"""Ranks outside a DTensor's mesh: they hold nothing and run nothing, as in torch.

A mesh may cover only some ranks of the world (``DeviceMesh("cpu", [0, 2])`` on a world of 4,
as pipeline stages use).  On the other ranks a DTensor holds an empty local tensor, an op on it
runs no kernel and no collective, and its results are placeholders with the decided specs:
an empty local tensor (``tensor(0)`` for a 0-d result), ``self`` for an in-place op, and for a
non-tensor result the neutral answer (``True`` for ``equal``, zero for ``item``).

Every off-mesh local tensor is built here or by ``from_local``/``distribute_tensor``, so it has
at most one element: dispatch looks up the rank's coordinate only for such small locals.
"""
from __future__ import annotations

from typing import Any

import torch

from .spec import DTensorSpec

__all__ = ["off_mesh_result", "empty_local"]


def empty_local(spec: DTensorSpec, device: torch.device) -> torch.Tensor:
    """An off-mesh rank's local tensor: 0-d zero for a 0-d DTensor, else a 1-D empty tensor."""
    if spec.ndim == 0:
        return torch.zeros((), dtype=spec.dtype, device=device)
    return torch.empty(0, dtype=spec.dtype, device=device)


def _neutral(ret: Any, dtype: torch.dtype | None) -> Any:
    kind = str(ret.type)
    if kind == "bool":
        return True
    if kind == "int":
        return 0
    if kind == "float":
        return 0.0
    if kind in ("Scalar", "number") and dtype is not None:
        return torch.zeros((), dtype=dtype).item()
    return None


def off_mesh_result(func: Any, output: Any, self_arg: Any, device: torch.device, dtype: torch.dtype | None,
                    returns_self: bool, wrap: Any) -> Any:
    """What an op returns on a rank outside the mesh (``wrap(local, spec)`` builds a DTensor)."""
    if returns_self:
        return self_arg

    def build(spec: Any, ret: Any) -> Any:
        if isinstance(spec, DTensorSpec):
            return wrap(empty_local(spec, device), spec)
        if isinstance(spec, (list, tuple)):
            return type(spec)(build(s, ret) for s in spec)
        return _neutral(ret, dtype) if ret is not None else None

    rets = func._schema.returns
    if isinstance(output, tuple) and len(rets) > 1:
        return tuple(build(s, r) for s, r in zip(output, rets))
    return build(output, rets[0] if rets else None)
