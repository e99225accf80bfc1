"""What auto-sharding reads off a model: its repeated blocks, cut-down copies, and the TP styles
that propagation implies for a block.

A model is a *root* (everything outside the repeated blocks: embeddings, final norm, head) and
one run of structurally equal *blocks* (the longest ``nn.ModuleList`` whose children have the same
class and parameter shapes).  Blocks share one decision, so a plan is priced on copies of the
model with 0 and 1 blocks; the cost of ``L`` blocks is the 1-block cost's block part times ``L``.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn as nn

from ..mesh import DeviceMesh
from ..parallel import ColwiseParallel, RowwiseParallel, parallelize_module

__all__ = ["Blocks", "find_blocks", "cut", "to_meta", "infer_tp_plan", "STYLES"]

STYLES: dict[str, Callable[[], Any]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


class Blocks:
    """Where a model's repeated blocks are: ``path`` of their ``nn.ModuleList`` and how many."""

    def __init__(self, path: str, count: int) -> None:
        self.path, self.count = path, count

    def of(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.path) if self.path else model  # type: ignore[return-value]

    def names(self, model: nn.Module) -> list[str]:
        return [f"{self.path}.{i}" if self.path else str(i) for i in range(len(self.of(model)))]


def _signature(m: nn.Module) -> tuple:
    return (type(m).__name__, tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()))


def find_blocks(model: nn.Module) -> Blocks | None:
    """The longest ``nn.ModuleList`` of parameterized, structurally equal children (None: none)."""
    best: Blocks | None = None
    for path, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0:
            continue
        sigs = {_signature(c) for c in m}
        if len(sigs) == 1 and any(True for _ in m[0].parameters()) and (best is None or len(m) > best.count):
            best = Blocks(path, len(m))
    return best


def cut(model: nn.Module, blocks: Blocks | None, keep: int) -> nn.Module:
    """A deep copy of ``model`` with only its first ``keep`` blocks (``model`` itself is not touched,
    so ranks may cut one shared model at once)."""
    if blocks is None:
        return copy.deepcopy(model)
    full = blocks.of(model)
    memo: dict[int, Any] = {}
    memo[id(full)] = copy.deepcopy(nn.ModuleList(list(full)[:keep]), memo)
    return copy.deepcopy(model, memo)


def to_meta(x: Any) -> Any:
    """Tensors (in nested tuples/lists/dicts) as meta tensors of the same shape and dtype."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("meta")
    if isinstance(x, (tuple, list)):
        return type(x)(to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: to_meta(v) for k, v in x.items()}
    return x


class _Reached(Exception):
    def __init__(self, name: str, x: Any) -> None:
        super().__init__(name)
        self.name, self.x = name, x


def infer_tp_plan(block: nn.Module, tp_mesh: DeviceMesh, args: tuple, kwargs: dict) -> dict[str, str]:
    """The TP style of each ``nn.Linear`` of ``block`` (Megatron's rule): a Linear whose input
    arrives as a piece of its features (the last dim, ``in_features / tp``: it descends from a
    column-wise Linear through per-feature ops) is row-wise, one whose input is whole is column-wise.

    The block runs (on meta) with the Linears decided so far parallelized as torch's styles do by
    default (local outputs), up to the first Linear not yet decided, whose input decides it.  One
    partial forward per Linear.
    """
    linears = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
    k = tp_mesh.size()
    plan: dict[str, str] = {}
    while len(plan) < len(linears):
        probe = copy.deepcopy(block)
        parallelize_module(probe, tp_mesh, {n: STYLES[s]() for n, s in plan.items()}, src_data_rank=None)
        for n in linears:
            if n not in plan:
                probe.get_submodule(n).register_forward_pre_hook(lambda _m, a, n=n: _raise(n, a[0]))
        try:
            probe(*args, **kwargs)
        except _Reached as r:
            features: int = block.get_submodule(r.name).in_features  # type: ignore[assignment]
            got = r.x.shape[-1]
            if got not in (features, -(-features // k)):
                raise ValueError(f"autoshard: cannot tell the TP style of {r.name}: its input has {got} features, "
                                 f"neither all {features} nor a 1/{k} piece") from None
            plan[r.name] = "colwise" if got == features else "rowwise"
            continue
        break  # the Linears left are never called
    return plan


def _raise(name: str, x: Any) -> None:
    raise _Reached(name, x)
