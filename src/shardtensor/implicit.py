"""Plain tensors meeting DTensors: when a plain ``torch.Tensor`` is taken as a replicated value.

A plain tensor that every rank builds identically is a replicated value, and is wrapped as
``Replicate()`` on the op's mesh (no copy, no communication).  shardtensor takes a plain tensor
that way only where it knows every rank built the same one:

- inside torch's autograd formulas (the backward pass): they build ``zeros``/``ones`` and index
  tensors from global shapes, e.g. ``zeros(sizes).scatter(dim, idx, grad)``;
- inside decompositions shardtensor runs for an op without a rule (SDPA's causal mask);
- one-element tensors (``torch.tensor(2.0) * dt``), as torch's DTensor does;
- index tensors torch builds from Python lists in ``dt[[0, 2]]`` (``DTensor.__getitem__``);
- inside ``with implicit_replication():``, where the user vouches for it.

Elsewhere a plain tensor mixed with DTensors raises ``MixedTensorError`` saying how to convert
it: a per-rank tensor taken for a replicated one would silently diverge.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from .errors import MixedTensorError

__all__ = ["MixedTensorError", "implicit_replication", "implicit_allowed", "plain_tensor_error"]


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
    return _state.depth > 0 or t.numel() == 1 or torch._C._current_graph_task_id() != -1


def plain_tensor_error(op: Any, t: torch.Tensor) -> MixedTensorError:
    return MixedTensorError(
        f"{op}: got a plain torch.Tensor of shape {tuple(t.shape)} mixed with DTensors. Convert it with "
        "distribute_tensor(t, mesh, placements) or DTensor.from_local(t, mesh, placements), or, if every rank "
        "holds the same values, wrap the code in shardtensor.implicit_replication()")
