"""``parallelize_module``: apply a plan of styles to a module's submodules."""
from __future__ import annotations

import warnings
from fnmatch import fnmatch

import torch.nn as nn

from ..mesh import DeviceMesh, resolve_mesh
from .style import ParallelStyle

__all__ = ["parallelize_module"]


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                       parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None, *,
                       src_data_rank: int | None = 0) -> nn.Module:
    """Apply tensor-parallel styles to ``module`` (in place) and return it.

    ``parallelize_plan`` is one style for ``module`` itself, or a dict from module paths to
    styles.  Each dotted level of a path is an fnmatch pattern over child names
    (``"layers.*.attention.wq"``); ``""`` is ``module`` itself.  A key that matches nothing
    warns and is skipped.  ``device_mesh`` must be 1-D: slice a larger mesh first
    (``mesh["tp"]``).  ``src_data_rank`` is the coordinate whose parameter values are
    scattered (``None``: each rank keeps its own values, no communication).
    """
    device_mesh = resolve_mesh(device_mesh, "parallelize_module")
    if device_mesh.ndim != 1:
        raise ValueError(f"parallelize_module needs a 1-D mesh, got shape {device_mesh.shape}; "
                         "pass a sub-mesh such as mesh['tp']")
    if parallelize_plan is None:
        warnings.warn("parallelize_module got no parallelize_plan; the module is left unchanged", stacklevel=2)
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan.src_data_rank = src_data_rank
        return parallelize_plan._apply(module, device_mesh)
    if not isinstance(parallelize_plan, dict):
        raise TypeError(f"parallelize_plan must be a ParallelStyle or a dict of them, got "
                        f"{type(parallelize_plan).__name__}")
    for path, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize_plan[{path!r}] must be a ParallelStyle, got {type(style).__name__}")
        for target in _resolve(module, path):
            parallelize_module(target, device_mesh, style, src_data_rank=src_data_rank)
    return module


def _resolve(module: nn.Module, path: str) -> list[nn.Module]:
    """Submodules whose path matches ``path`` level by level (fnmatch per dotted token)."""
    if path == "":
        return [module]
    found = [module]
    for token in path.split("."):
        found = [c for m in found for name, c in m.named_children() if fnmatch(name, token)]
        if not found:
            warnings.warn(f"parallelize_plan key {path!r}: no submodule matches {token!r}; skipping it",
                          stacklevel=3)
            return []
    return found
