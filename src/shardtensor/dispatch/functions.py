"""Torch functions on DTensors: torch's default handling, with repairs where torch's C++ works
outside dispatch, on memory or plain tensors a DTensor cannot stand for.

- **Indexing with a Python list** (``x[[0, 2]]``, ``x[:, [1, 3]] = v``): C++ turns the list into
  an index tensor, built alike on every rank from the same literal, so it is taken as a
  replicated value.  A plain index tensor the caller passes is not (see docs/propagation.md).
- **``tensor_split`` at a tensor of split points** reads the points from memory: a DTensor of
  them is read whole first.
- **``scaled_dot_product_attention`` with the sequence sharded** runs as ring attention
  (``cp/dtensor.py``) instead of moving the sequence to heads.
- **3-D ``scaled_dot_product_attention``** takes torch's math path, which builds its causal
  mask as a plain tensor: the inputs get a leading batch dim of 1, so the 4-D path (and its
  sharding rule) runs, and the result drops it again.
- **A plain tensor a composite builds from metadata alone** (``matrix_rank`` of an empty
  matrix) is the same on every rank: a ``Replicate`` DTensor, not a wrapper without a spec.
  Autograd's entry points are not such composites: ``torch.autograd.grad`` returns each input's
  gradient as the input's kind (a plain input's is plain), as AOTAutograd's traced backward
  relies on.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..cp.dtensor import seq_sharded_attention
from ..implicit import implicit_replication
from ..tensor import DTensor, below
from .fallback import replicate_plain

__all__ = ["torch_function", "REPAIRED", "finish", "optimizers_take_foreach"]


def optimizers_take_foreach() -> None:
    """``torch.optim`` optimizers (and ``clip_grad_norm_``) pick their ``foreach`` implementation
    by default only for the tensor types on two lists of torch's; PyTorch's DTensor adds itself
    there.  Without ours on them an optimizer over DTensor parameters ran its per-parameter loop,
    about twice the time of a foreach step (benchmarks/README.md)."""
    import importlib

    for module in ("torch.optim.optimizer", "torch.utils._foreach_utils"):
        types = getattr(importlib.import_module(module), "_foreach_supported_types", None)
        if isinstance(types, list) and DTensor not in types:
            types.append(DTensor)


_AS_IS = frozenset(torch.overrides.get_default_nowrap_functions()) | {
    torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward}
"""Functions whose results ``finish`` leaves alone: torch's own no-wrap list, and autograd's entry
points (gradients come back as autograd made them: a plain input's gradient stays plain)."""
_TENSOR_SPLIT = torch.Tensor.tensor_split
_GETITEM, _SETITEM = torch.Tensor.__getitem__, torch.Tensor.__setitem__
_SDPA = F.scaled_dot_product_attention

REPAIRED = frozenset({torch.tensor_split, _TENSOR_SPLIT, _GETITEM, _SETITEM, _SDPA})
"""The functions ``torch_function`` looks at before running them; every other function goes
straight to ``below`` (``DTensor.__torch_function__`` checks this first: the hot path)."""

def torch_function(func: Any, types: tuple, args: tuple, kwargs: dict | None) -> Any:
    """Run ``func`` below torch-function handling; results are DTensors or plain Python values."""
    if func is torch.tensor_split or func is _TENSOR_SPLIT:
        args, kwargs = _whole_split_points(args, kwargs or {})
    elif (func is _GETITEM or func is _SETITEM) and _literal_index(args[1], args[2:]):
        with implicit_replication():
            return below(func, types, args, kwargs) if kwargs else below(func, types, args)
    elif func is _SDPA:
        if _is_3d(args, kwargs or {}):
            return _sdpa_batched(args, kwargs or {})
        out = seq_sharded_attention(args, kwargs or {})
        if out is not NotImplemented:
            return out
    out = below(func, types, args, kwargs) if kwargs else below(func, types, args)
    return finish(func, out, args, kwargs)


def finish(func: Any, out: Any, args: tuple, kwargs: dict | None) -> Any:
    """``func``'s result with any plain tensor torch's C++ built from shapes alone made a
    ``Replicate`` DTensor (the same on every rank)."""
    t = type(out)
    if t is DTensor or t in _PLAIN_VALUES or func in _AS_IS:
        return out
    if (t is list or t is tuple) and (func in _LIST_FUNCS or all(type(o) is DTensor for o in out)):
        return out  # foreach results (a plain one comes from plain list elements: listops.py)
    return replicate_plain(out, args, kwargs or {})


_LIST_FUNCS = frozenset(getattr(torch, n) for n in dir(torch) if n.startswith("_foreach_"))
_PLAIN_VALUES = frozenset({type(None), bool, int, float, complex, str, torch.Size, torch.dtype, torch.device,
                           torch.layout})


def _whole_split_points(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``tensor_split``'s DTensor of split points as the Python list (or int) it stands for."""
    if len(args) > 1 and isinstance(args[1], DTensor):
        args = (args[0], args[1].full_tensor().tolist(), *args[2:])
    for name in ("indices_or_sections", "tensor_indices_or_sections"):
        if isinstance(kwargs.get(name), DTensor):
            kwargs = dict(kwargs)
            points = kwargs.pop(name).full_tensor().tolist()
            kwargs["sections" if isinstance(points, int) else "indices"] = points
    return args, kwargs


def _literal_index(index: Any, value: tuple) -> bool:
    """Whether ``index`` holds a Python list (turned into a tensor by torch) and no plain tensor,
    and a written ``value`` (``__setitem__``) is not a plain tensor either."""
    if value and isinstance(value[0], torch.Tensor) and not isinstance(value[0], DTensor):
        return False
    parts = index if isinstance(index, tuple) else (index,)
    has_list = False
    for p in parts:
        if isinstance(p, torch.Tensor) and not isinstance(p, DTensor):
            return False
        has_list |= isinstance(p, list)
    return has_list


_SDPA_TENSORS = ("query", "key", "value", "attn_mask")


def _is_3d(args: tuple, kwargs: dict) -> bool:
    q = args[0] if args else kwargs.get("query")
    return isinstance(q, DTensor) and q.ndim == 3


def _sdpa_batched(args: tuple, kwargs: dict) -> Any:
    """3-D attention as 4-D with a batch of one (the same values: a leading dim broadcasts)."""
    named = dict(zip(_SDPA_TENSORS, args))
    named.update(kwargs)
    for name in _SDPA_TENSORS:
        t = named.get(name)
        if isinstance(t, torch.Tensor) and (name != "attn_mask" or t.ndim == 3):
            named[name] = t.unsqueeze(0)
    return _SDPA(**named).squeeze(0)
