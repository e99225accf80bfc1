"""Price a plan by running one training step of it, on the meta device, as rank 0 of a world of shapes.

The step is the one the user will run -- forward, loss, backward, optimizer step -- through the
same dispatch, propagation, redistribution planner and FSDP hooks, so the collectives it records
(``comm.issue``'s events: bytes each rank receives under the ring model) are the ones a real run
records, by construction.  Nothing is allocated: local tensors are meta, collectives only shape
their results (``comm.shapes``).  Around it a dispatch mode counts the *local* work each op does on
rank 0's pieces: FLOPs (torch's flop formulas) and bytes written.  Time is then

    compute: flops / device.flops + bytes written / device.memory_bw
    comm:    per collective, launch + hops * (k - 1) * alpha + beta * bytes received   (the planner's model)

and memory per rank: parameters, gradients and optimizer states (their local pieces), the
activations autograd saves (local pieces, each saved tensor once), and FSDP's gathered parameters.
Attention on plain tensors is priced as a fused kernel (``_FusedAttention``), as a GPU runs it.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..comm.issue import CommEvent, recording
from ..comm.shapes import one_rank
from ..fsdp import FSDPModule
from ..observe import is_deciding
from ..mesh import DeviceMesh, init_device_mesh
from ..redistribute.cost import LinkModel, link_of
from ..redistribute.moves import MOVES
from ..tensor import DTensor

__all__ = ["Device", "Cost", "price"]


@dataclass(frozen=True)
class Device:
    """One accelerator: dense FLOP/s and memory bytes/s (default: an H100-class GPU in bf16)."""

    flops: float = 7e14
    memory_bw: float = 3e12


@dataclass
class Cost:
    """What one training step costs rank 0: bytes received, seconds, and memory in bytes."""

    bytes: float = 0.0
    collectives: float = 0.0
    comm_s: float = 0.0
    flops: float = 0.0
    compute_s: float = 0.0
    params: float = 0.0
    grads: float = 0.0
    optim: float = 0.0
    activations: float = 0.0
    held: float = 0.0
    """Gathered parameters of units that keep them from forward to backward (``reshard=False``)."""
    gathered: float = 0.0
    """The largest gathered unit among those freed after forward: the transient peak they add."""

    @property
    def step_s(self) -> float:
        return self.comm_s + self.compute_s

    @property
    def memory(self) -> float:
        return self.params + self.grads + self.optim + self.activations + self.held + self.gathered

    def _zip(self, other: "Cost", fn: Callable[[float, float], float]) -> "Cost":
        return Cost(**{f.name: fn(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})

    def __add__(self, other: "Cost") -> "Cost":
        out = self._zip(other, operator.add)
        out.gathered = max(self.gathered, other.gathered)  # one unit gathered at a time
        return out

    def __sub__(self, other: "Cost") -> "Cost":
        return self._zip(other, operator.sub)

    def times(self, k: int) -> "Cost":
        out = Cost(**{f.name: getattr(self, f.name) * k for f in fields(self)})
        out.gathered = self.gathered
        return out


class _LocalWork(TorchDispatchMode):
    """Counts the FLOPs and bytes written of every op on plain (local) tensors; DTensor ops are
    handed to DTensor's own dispatch with the mode still on, so their local kernels are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0.0
        self.written = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            with self:
                return DTensor.__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **kwargs)
        if is_deciding():  # a rule working out shapes, not rank 0's work
            return out
        packet = func._overloadpacket
        formula = flop_registry.get(_FLOPS_AS.get(packet, packet))
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.written += t.numel() * t.element_size()
        return out


_aten = torch.ops.aten
_FLOPS_AS = {_aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
             _aten._scaled_dot_product_flash_attention_for_cpu_backward:
                 _aten._scaled_dot_product_flash_attention_backward}


class _FusedAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` on plain tensors priced as a fused kernel (what a GPU runs:
    the ``t x t`` scores never stored), with torch's CPU flash kernel standing in on meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and _fusable(*args, **kwargs):
            q, k, v = args[:3]
            return _aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False), scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


def _fusable(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: Any = None, enable_gqa: bool = False) -> bool:
    return (attn_mask is None and not enable_gqa and all(type(t) is torch.Tensor for t in (q, k, v))
            and q.shape[:-2] == k.shape[:-2] == v.shape[:-2])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _nbytes(ts: Any) -> float:
    return float(sum(_local(t).numel() * _local(t).element_size() for t in ts))


def comm_seconds(events: list[CommEvent], links: tuple[LinkModel, ...], shape: tuple[int, ...]) -> float:
    """The alpha-beta time of rank 0's collectives on a mesh of ``shape`` (ranks in row-major order),
    as the redistribution planner prices a step: ``launch + hops (k - 1) alpha + beta bytes`` (an
    all-reduce makes two ring passes), on the link of the mesh dims its group spans (``link_of``: the
    slowest of each term).  The dims come from the group, not from ``mesh_dim``, which counts the
    dims of whatever sub-mesh or flattened mesh the collective ran on."""
    coord = list(itertools.product(*(range(k) for k in shape)))  # rank -> its row-major coordinate
    total = 0.0
    for e in events:
        dims = [j for j in range(len(shape)) if len({coord[r][j] for r in e.group}) > 1] or list(range(len(shape)))
        link = link_of(dims, links)
        total += link.launch + _HOPS.get(e.kind, 1) * (e.group_size - 1) * link.alpha + link.beta * e.bytes_received
    return total


_HOPS = {m.collective: m.hops for m in MOVES.values() if m.hops}


def _gathered(model: nn.Module) -> tuple[float, float]:
    """(held, largest freed) bytes of FSDP units' gathered parameters, per rank."""
    held = freed = 0.0
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        st = m._fsdp_state
        size = float(sum(fp.numel * fp.orig_dtype.itemsize for fp in st.group.params))
        if st.reshard_after_forward and not st.is_root:
            freed = max(freed, size)
        else:
            held += size
    return held, freed


def price(build: Callable[[DeviceMesh], nn.Module], shape: tuple[int, ...], names: tuple[str, ...],
          inputs: tuple, loss_fn: Callable[[Any], torch.Tensor], optimizer: str,
          device: Device, links: tuple[LinkModel, ...]) -> Cost:
    """One training step of ``build(mesh)`` on meta ``inputs``, as rank 0 of a world of shapes."""
    world = 1
    for k in shape:
        world *= k
    with one_rank(world):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = build(mesh)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = _optimizer(optimizer, params)
        saved: dict[int, float] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            loc = _local(t)
            saved.setdefault(id(loc), loc.numel() * loc.element_size())
            return t

        work = _LocalWork()
        with recording() as log, work, _FusedAttention():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = loss_fn(model(*inputs))
            loss.backward()
            if opt is not None:
                opt.step()
        events = [e for e in log.events if e.rank == 0]
        held, freed = _gathered(model)
        cost = Cost(bytes=float(sum(e.bytes_received for e in events)), collectives=float(len(events)),
                    comm_s=comm_seconds(events, links, shape), flops=work.flops,
                    compute_s=work.flops / device.flops + work.written / device.memory_bw,
                    params=_nbytes(params), grads=_nbytes(p.grad for p in params if p.grad is not None),
                    optim=_nbytes(v for st in (opt.state.values() if opt is not None else ()) for v in st.values()
                                  if isinstance(v, torch.Tensor) and v.ndim > 0),
                    activations=float(sum(saved.values())), held=held, gathered=freed)
    return cost


def _optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer | None:
    if name in ("none", None):
        return None
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}.get(name)
    if cls is None:
        raise ValueError(f"autoshard: optimizer must be 'adamw', 'adam', 'sgd' or 'none', got {name!r}")
    return cls(params, lr=1e-3, foreach=False)
