"""``distribute_module``: a module's parameters as DTensors, and hooks on its inputs and outputs
(the plumbing every parallel style installs through)."""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch.nn as nn

from ..mesh import DeviceMesh, resolve_mesh
from ..placement import Replicate
from ..tensor import DTensor, distribute_tensor
from .hooks import MeshPostHook, MeshPreHook

__all__ = ["distribute_module"]


def _replicate_rest(m: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate the parameters and buffers of ``m`` itself that are not DTensors yet."""
    full = [Replicate()] * mesh.ndim
    for key, p in list(m._parameters.items()):
        if p is not None and not isinstance(p, DTensor):
            m.register_parameter(key, nn.Parameter(distribute_tensor(p.data, mesh, full),
                                                   requires_grad=p.requires_grad))
    for key, b in list(m._buffers.items()):
        if b is not None and not isinstance(b, DTensor):
            m._buffers[key] = distribute_tensor(b, mesh, full)


def _arity(fn: Callable, who: str) -> int:
    n = len(inspect.signature(fn).parameters)
    if n not in (2, 3):
        raise ValueError(f"{who} must take (module, value, device_mesh) or (value, device_mesh); it takes {n} arguments")
    return n


def distribute_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                      partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
                      input_fn: Callable[..., Any] | None = None,
                      output_fn: Callable[..., Any] | None = None) -> nn.Module:
    """Turn ``module``'s parameters into DTensors and hook its inputs and outputs.

    ``partition_fn(name, submodule, mesh)`` runs for every submodule and may register
    DTensor parameters; whatever it leaves as a plain tensor (all of them without a
    partition_fn) is replicated.  ``input_fn(module, inputs, mesh)`` becomes a forward
    pre-hook and ``output_fn(module, outputs, mesh)`` a forward hook (the two-argument forms
    without ``module`` are accepted too).  A module can be distributed once.
    """
    device_mesh = resolve_mesh(device_mesh, "distribute_module")
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError(f"distribute_module was already applied to this {type(module).__name__}")
    if partition_fn is None:
        for sub in module.modules():
            _replicate_rest(sub, device_mesh)
    else:
        for name, sub in module.named_modules():
            partition_fn(name, sub, device_mesh)
            _replicate_rest(sub, device_mesh)
    if input_fn is not None:  # hooks that torch.compile traces (hooks.py)
        module.register_forward_pre_hook(MeshPreHook(input_fn, device_mesh, _arity(input_fn, "input_fn") == 3))
    if output_fn is not None:
        module.register_forward_hook(MeshPostHook(output_fn, device_mesh, _arity(output_fn, "output_fn") == 3))
    module._distribute_module_applied = True  # type: ignore[assignment]
    return module

