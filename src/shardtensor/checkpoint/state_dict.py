"""Model and optimizer state dicts with whole tensors, as ``torch.distributed.checkpoint.state_dict``.

torch's helpers (``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
cpu_offload=True))`` and the rest) recognise only torch's own DTensor, so on shardtensor models
they hand back sharded tensors.  These functions take the same arguments and give what torch's
give for torch's DTensor:

* ``full_state_dict=True``: every DTensor is gathered whole (a collective: call on every rank);
  with ``cpu_offload=True`` too, rank 0 gets the tensors on CPU and the other ranks ``{}``.
* without it: the DTensors themselves (``cpu_offload`` moves their local blocks to CPU).
* ``set_*``: whole tensors (or DTensors of any layout) are laid out like the model's own
  parameters and loaded; ``broadcast_from_rank0=True`` reads them from rank 0 only.
* ``ignore_frozen_params`` drops parameters that do not require grad; ``strict`` is
  ``load_state_dict``'s.

Optimizer state dicts are keyed by parameter names (FQNs), as torch's helpers key them, so they
load into a model parallelized differently.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from ..tensor import DTensor, distribute_tensor

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]


def _rank() -> int:
    from ..comm import current_transport

    return current_transport().rank


def _out(value: Any, opts: StateDictOptions) -> Any:
    """One value as the options want it (gathered whole, offloaded)."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor):
        if opts.full_state_dict:
            value = value.full_tensor()
        elif opts.cpu_offload:
            local = value.to_local().detach().cpu()
            return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
    value = value.detach()
    return value.cpu() if opts.cpu_offload else value


def _finish(sd: dict[str, Any], opts: StateDictOptions) -> dict[str, Any]:
    if opts.full_state_dict and opts.cpu_offload and _rank() != 0:
        # rank 0 alone keeps the tensors; the others gather too (the collectives must match) but copy nothing
        _tree(sd, dataclasses.replace(opts, cpu_offload=False))
        return {}
    return {k: _tree(v, opts) for k, v in sd.items()}


def _tree(v: Any, opts: StateDictOptions) -> Any:
    if isinstance(v, dict):
        return {k: _tree(x, opts) for k, x in v.items()}
    if isinstance(v, list):
        return [_tree(x, opts) for x in v]
    return _out(v, opts)


def get_model_state_dict(model: nn.Module, *, submodules: Any = None,
                         options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model's state dict under ``options`` (torch's ``StateDictOptions``)."""
    if submodules is not None:
        raise NotImplementedError("get_model_state_dict(submodules=...) is deprecated in torch; pass the model")
    opts = options or StateDictOptions()
    sd = model.state_dict()
    if opts.ignore_frozen_params:
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        sd = {k: v for k, v in sd.items() if k not in frozen}
    return _finish(sd, opts)


def _like(target: torch.Tensor, value: Any, key: str) -> Any:
    """``value`` laid out as ``target`` (a whole tensor distributed, a DTensor redistributed)."""
    if not isinstance(target, DTensor):
        return value.full_tensor() if isinstance(value, DTensor) else value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"state dict entry {key!r}: expected a tensor for a DTensor parameter, got {type(value).__name__}")
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"state dict entry {key!r}: shape {tuple(value.shape)} does not match the model's "
                         f"{tuple(target.shape)}")
    if isinstance(value, DTensor):
        value = value.full_tensor()
    value = value.to(device=target.to_local().device, dtype=target.dtype)
    out = distribute_tensor(value, target.device_mesh, list(target.placements))
    if out.shard_order != target.shard_order:
        out = out.redistribute(target.device_mesh, list(target.placements),
                               shard_order={d: list(ms) for d, ms in target.shard_order})
    return out


def _from_rank0(sd: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's whole tensors on every rank (keys from ``like``, the model's own entries)."""
    from .. import comm
    from ..mesh import DeviceMesh

    world = comm.current_transport().world_size
    meshes: dict[str, DeviceMesh] = {}
    out = {}
    for key, target in like.items():
        if not isinstance(target, torch.Tensor):
            continue
        dev = target.to_local().device if isinstance(target, DTensor) else target.device
        if _rank() == 0:
            src = sd[key].full_tensor() if isinstance(sd[key], DTensor) else sd[key]
            buf = src.detach().to(device=dev, dtype=target.dtype).contiguous()
        else:
            buf = torch.empty(tuple(target.shape), dtype=target.dtype, device=dev)
        if dev.type not in meshes:  # one mesh over the whole world per device type (built by every rank)
            meshes[dev.type] = DeviceMesh(dev.type, torch.arange(world))
        out[key] = comm.broadcast(buf, 0, meshes[dev.type], 0)
    return out


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None) -> Any:
    """Load whole tensors (or DTensors of any layout) into the model; ``load_state_dict``'s result."""
    opts = options or StateDictOptions()
    own = model.state_dict()
    sd = _from_rank0(model_state_dict, own) if opts.broadcast_from_rank0 else model_state_dict
    new = {k: (_like(own[k], v, k) if k in own and isinstance(own[k], torch.Tensor) else v) for k, v in sd.items()}
    return model.load_state_dict(new, strict=opts.strict)


# -- optimizers ------------------------------------------------------------------------------

def _optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def _index_names(model: nn.Module, opt: torch.optim.Optimizer, osd: dict[str, Any]) -> dict[int, str]:
    """The optimizer state dict's parameter indices mapped to the model's parameter names."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for g_sd, g in zip(osd["param_groups"], opt.param_groups):
        for i, p in zip(g_sd["params"], g["params"]):
            if id(p) not in names:
                raise ValueError("an optimizer parameter is not a parameter of the model")
            out[i] = names[id(p)]
    return out


def get_optimizer_state_dict(model: nn.Module, optimizers: Any, *, submodules: Any = None,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizers' state keyed by parameter names: ``{"state": {fqn: {...}}, "param_groups": [...]}``."""
    opts = options or StateDictOptions()
    if submodules is not None or opts.flatten_optimizer_state_dict:
        raise NotImplementedError("get_optimizer_state_dict: submodules= and flatten_optimizer_state_dict are not "
                                  "supported; pass the model and the default options")
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for opt in _optimizers(optimizers):
        osd = opt.state_dict()
        names = _index_names(model, opt, osd)
        state.update({names[i]: st for i, st in osd["state"].items()})
        groups += [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]
    return _finish({"state": state, "param_groups": groups}, opts)


def _state_value(p: torch.Tensor, v: Any, key: str) -> Any:
    """A state entry for parameter ``p``: laid out like ``p`` when it has ``p``'s shape (``exp_avg``),
    as given otherwise (``step``); always a copy, so the optimizer never updates the caller's dict."""
    if not isinstance(v, torch.Tensor):
        return v
    if tuple(v.shape) == tuple(p.shape):
        v = _like(p, v, key)
    return v.clone()


def set_optimizer_state_dict(model: nn.Module, optimizers: Any, optim_state_dict: dict[str, Any], *,
                             options: StateDictOptions | None = None) -> None:
    """Load a name-keyed optimizer state dict (whole tensors or DTensors of any layout) into ``optimizers``."""
    opts = options or StateDictOptions()
    if opts.broadcast_from_rank0 or opts.flatten_optimizer_state_dict:
        raise NotImplementedError("set_optimizer_state_dict: broadcast_from_rank0 and flatten_optimizer_state_dict "
                                  "are not supported; pass the state dict on every rank")
    params = dict(model.named_parameters())
    saved_groups = optim_state_dict["param_groups"]
    at = 0
    for opt in _optimizers(optimizers):
        osd = opt.state_dict()
        names = _index_names(model, opt, osd)
        index = {n: i for i, n in names.items()}
        state = {}
        for name, st in optim_state_dict["state"].items():
            if name in index:
                p = params[name]
                state[index[name]] = {k: _state_value(p, v, f"{name}.{k}") for k, v in st.items()}
        mine = saved_groups[at:at + len(osd["param_groups"])]
        at += len(osd["param_groups"])
        groups = [{**g, "params": cur["params"]} for g, cur in zip(mine, osd["param_groups"])]
        opt.load_state_dict({"state": state, "param_groups": groups})


def get_state_dict(model: nn.Module, optimizers: Any, *, submodules: Any = None,
                   options: StateDictOptions | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(get_model_state_dict, get_optimizer_state_dict)`` of one model and its optimizers."""
    return (get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def set_state_dict(model: nn.Module, optimizers: Any, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any], options: StateDictOptions | None = None) -> Any:
    """Both halves of ``get_state_dict``'s result; ``load_state_dict``'s result for the model."""
    out = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return out
