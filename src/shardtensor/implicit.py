"""Plain tensors meeting DTensors: when a plain ``torch.Tensor`` is taken as a replicated value.

A plain tensor that every rank builds identically is a replicated value, and is wrapped as
``Replicate()`` on the op's mesh (no copy, no communication).  shardtensor takes a plain tensor
that way only where it knows every rank built the same one:

- inside torch's autograd formulas (the backward pass): they build ``zeros``/``ones`` and index
  tensors from global shapes, e.g. ``zeros(sizes).scatter(dim, idx, grad)``;
- inside decompositions shardtensor runs for an op without a rule (SDPA's causal mask);
- one-element tensors (``torch.tensor(2.0) * dt``), as torch's DTensor does, and one element
  expanded (torch's C++ composites broadcast a scalar ``q`` against a DTensor in ``quantile``);
- index tensors torch builds from Python lists in ``dt[[0, 2]]`` (``DTensor.__getitem__``);
- inside ``with implicit_replication():``, where the user vouches for it.

A plain tensor torch builds inside a torch function (or torch's own Python) called on DTensors
with no plain tensor among its own arguments (``torch.combinations``' mask, ``matrix_power``'s
identity, ``svd_lowrank``'s random projection, ``torch.masked.var``'s counts) is built by every
rank from the same arguments; dispatch
takes it as replicated after the ranks compare a fingerprint of it (``built_by_torch``;
``rng.agreed`` takes coordinate 0's where they differ: random numbers from generators that
differ).

Elsewhere a plain tensor mixed with DTensors raises ``MixedTensorError`` saying how to convert
it: a per-rank tensor taken for a replicated one would silently diverge.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten

from .errors import MixedTensorError

__all__ = ["MixedTensorError", "implicit_replication", "implicit_allowed", "plain_tensor_error", "built_by_torch"]


class _State(threading.local):
    depth = 0


_state = _State()


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside the block, plain tensors mixed with DTensors are replicated values (as torch's
    ``torch.distributed.tensor.experimental.implicit_replication``).  Per thread, so per
    simulated rank; nests.  shardtensor enters it itself around the decompositions it runs."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1


def implicit_allowed(t: torch.Tensor) -> bool:
    """Whether the plain tensor ``t`` may be taken as a replicated value here."""
    return (_state.depth > 0 or t.numel() == 1 or torch._C._current_graph_task_id() != -1
            or all(s == 0 for s, n in zip(t.stride(), t.shape) if n > 1))  # one value, expanded


def built_by_torch() -> bool:
    """Whether the caller runs inside torch code called on DTensors with no plain tensor of more
    than one element among its arguments: a plain tensor met there was built by torch from them.

    Walks the Python stack outward (on the error path only) through torch's and shardtensor's
    own frames up to the first frame of other code, and looks at the outermost call it passed:
    a torch function on DTensors (``DTensor.__torch_function__``) or a function of torch's own
    Python (``torch.masked.var``).  User code in between (a module's ``forward``) ends the walk
    there, so a plain tensor the user made is never taken for one torch built."""
    outer: Any = None
    f: Any = sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(_OURS) or f.f_code.co_filename.startswith(_TORCH)):
        if f.f_code in TORCH_FUNCTION_CODES or f.f_code.co_filename.startswith(_TORCH):
            outer = f
        f = f.f_back
    if outer is None:
        return False
    local = outer.f_locals
    if outer.f_code in TORCH_FUNCTION_CODES:
        values: Any = (local.get("args"), local.get("kwargs"))
    else:
        c = outer.f_code
        n = c.co_argcount + c.co_kwonlyargcount + bool(c.co_flags & 4) + bool(c.co_flags & 8)
        values = [local.get(name) for name in c.co_varnames[:n]]
    leaves = tree_flatten(values)[0]
    return not any(isinstance(a, torch.Tensor) and not hasattr(a, "_local_tensor") and a.numel() > 1 for a in leaves)


TORCH_FUNCTION_CODES: set[Any] = set()
"""The code of ``DTensor.__torch_function__`` (``tensor.py`` adds it: this module sits below it)."""
_TORCH = os.path.dirname(torch.__file__) + os.sep
_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep


def plain_tensor_error(op: Any, t: torch.Tensor) -> MixedTensorError:
    return MixedTensorError(
        f"{op}: got a plain torch.Tensor of shape {tuple(t.shape)} mixed with DTensors. Convert it with "
        "distribute_tensor(t, mesh, placements) or DTensor.from_local(t, mesh, placements), or, if every rank "
        "holds the same values, wrap the code in shardtensor.implicit_replication()")
