"""``fully_shard``'s forward hooks, which dynamo traces (``compile.py``).

Eagerly each hook hands over to ``FSDPState`` (the all-gather into reused buffers, prefetch,
freeing storage).  Under ``torch.compile`` a module whose group can be traced instead gets its
unsharded parameters from ``traced.gather_group``, one node of the graph per group: the
all-gather and, in backward, the reduce-scatter are the graph's own collectives, so a model
with ``fully_shard`` compiles with no graph break.  Keep the bodies plain Python.

A nested module with ``reshard_after_forward`` (and more than one dp rank) has its gather
checkpointed with every op run again in backward (``traced.regather_in_backward``): the compiled
forward keeps the sharded parameters and backward gathers again, as eager frees and re-gathers.
A root keeps its unsharded parameters, as eager.  (A partitioner that honours recompute tags does
this, as inductor's; the ``aot_eager`` backend's keeps what it saves.)
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from .traced import regather_in_backward

__all__ = ["PostForward", "PreForward", "cast_floats"]


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Floating tensors of ``tree`` in ``dtype`` (mixed precision's input and output casts)."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    and t.dtype != dtype else t, tree)


def _traceable(group: Any) -> bool:
    """Whether a compiled forward gathers the group in its graph: a group ``traced.py`` can
    gather, and no unsynchronized gradients or replicas' blocks (buffers outside any graph)
    waiting to be reduced."""
    return (group.traced_key is not None and group.sync and not group.unreduced and group.all_reduce
            and not group.replica_part)


class PreForward:
    """Forward pre-hook (with kwargs): the module computes with unsharded parameters."""

    def __init__(self, state: Any, gather: Any) -> None:
        self.state, self.gather = state, gather

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> Any:
        state = self.state
        group = state.group
        if not (torch.compiler.is_dynamo_compiling() and _traceable(group)):
            return state.pre_forward(module, args, kwargs)
        mp = state.mp
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = cast_floats((args, kwargs), mp.param_dtype)
        params = group.params
        sharded = [p.sharded for p in params]
        if not params:
            unsharded: Any = ()
        elif state.reshard_after_forward and state.nested and group.info.world > 1:  # as eager frees them
            unsharded = checkpoint(self.gather, group.traced_key, *sharded, use_reentrant=False,
                                   context_fn=regather_in_backward)
        else:
            unsharded = self.gather(group.traced_key, *sharded)
        for p, t in zip(params, unsharded):
            for mod, name in p.owners:
                mod._parameters[name] = t
        return args, kwargs


class PostForward:
    """Forward hook (with kwargs): the sharded parameters come back."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def __call__(self, module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        state = self.state
        group = state.group
        if not (torch.compiler.is_dynamo_compiling() and _traceable(group)):
            return state.post_forward(module, args, kwargs, output)
        for p in group.params:  # (group.show_sharded, which dynamo would not trace)
            for mod, name in p.owners:
                mod._parameters[name] = p.sharded
        if state.mp.output_dtype is not None:
            output = cast_floats(output, state.mp.output_dtype)
        return output
