"""Fully sharded data parallelism (mirrors ``torch.distributed.fsdp.fully_shard``, FSDP2).

``fully_shard(module, mesh=..., reshard_after_forward=True, mp_policy=MixedPrecisionPolicy())``
is applied bottom-up (blocks, then the root).  Each call manages the parameters of ``module``
that no child ``fully_shard`` manages, as one group:

=================  =============================================================================
when               what happens (per module, per rank)
=================  =============================================================================
fully_shard        each parameter becomes ``nn.Parameter(DTensor)``, ``Shard(0)`` on the dp mesh
                   dim (torch.chunk rule: 7 rows over 4 ranks -> 2, 2, 2, 1; 3 -> 1, 1, 1, 0)
forward pre-hook   copy-in (one ``cat`` of the padded local shards, cast to ``param_dtype``),
                   ONE all-gather over dp, copy-out (``split_with_sizes_copy``) into the
                   unsharded buffers; the module sees the unsharded tensors
forward hook       the sharded parameters are put back; ``reshard_after_forward`` frees the
                   unsharded storage (not for the root, whose backward comes next); a hook on
                   the outputs re-gathers before the module's backward
backward           unsharded gradients -> ``chunk_cat`` (cast to ``reduce_dtype``) -> ONE
                   reduce-scatter (average over dp) -> ``param.grad`` = sharded DTensor
=================  =============================================================================

Meshes.  A 1-D mesh is FSDP.  A 2-D mesh is HSDP as in torch (replicate over dim 0, shard
over dim 1: gradients are reduce-scattered over dim 1, then all-reduced over dim 0), except a
2-D mesh with dims named ``("dp", "tp")``, which is FSDP on dp with TP on tp.  TP parameters
(DTensors on ``mesh["tp"]``, e.g. from ``parallelize_module``) joined with a ``fully_shard`` on
``mesh["dp"]`` (torch's 2-D recipe) live on the mesh both were cut from.

Layout.  Let ``U`` be the tensor the forward computes with: the whole parameter, or a TP
parameter's TP-local piece.  FSDP always chunks dim 0 of ``U`` over dp: rank ``r`` keeps rows
``[r*c, r*c + rows)`` with ``c = ceil(U.size(0) / W)``, stored in a zero-padded ``(c, ...)``
block so that every rank sends the same number of elements.  The sharded parameter is a
DTensor on the FSDP mesh with ``Shard(0)`` on dp and the TP placement on tp; when the TP
placement is itself ``Shard(0)`` the dp shard nests inside the tp shard, which the spec
records as the shard order ``{0: [tp, dp]}`` (tp splits first).  The unsharded parameter is
a plain tensor (1-D mesh, or a parameter that is not a DTensor) or a DTensor on
``mesh["tp"]`` with the TP placement, so TP compute dispatches as usual.

Autograd: a custom Function maps the sharded parameters to the unsharded ones; its backward
receives the unsharded gradients (TP gradients are first redistributed to the parameter's
TP placement) and returns the reduce-scattered sharded gradients, so any ``torch.optim``
optimizer steps the sharded DTensor parameters directly.  Mixed precision: sharded
parameters and gradients keep their dtype; ``param_dtype`` is used for the all-gather and
the compute, ``reduce_dtype`` (default: ``param_dtype``) for the reduce-scatter.

Prefetch.  The first forward records the order of the modules' forwards.  From then on each
module's pre-forward issues the next module's all-gather asynchronously right after its own,
and each module's pre-backward issues the re-gather of the module whose backward comes next
(reverse post-forward order), so the collective runs while this module computes.
``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` set the modules
explicitly (``[]``: none).  A prefetch a forward leaves unused is dropped at the next forward.

Ragged layouts.  ``shard_placement_fn(param)`` may give ``RaggedShard(0, local_units)`` (per-rank
pieces of chosen sizes; ``layouts.py`` builds two: whole parameters per rank, and pieces cut on
128-element blocks).  Such a parameter's shard is exactly its piece (no padding); the group's
flat buffer holds the even parameters first, then rank ``r``'s ragged pieces end to end, each
rank's block padded to the longest, so one all-gather and one reduce-scatter still serve the
whole group, and the gradients come back with the parameter's ragged placement.

Gradient accumulation: ``module.set_requires_gradient_sync(False)`` makes backward keep each
rank's unsharded local gradients in a buffer with no collective; the next backward with sync
on reduces their sum once.

Under ``torch.compile`` (``hooks.py``) a module's hooks instead get its parameters from one
graph node (``traced.gather_group``): the same copy-in, all-gather and copy-out, and in
backward the same reduce-scatter, written functionally, so the graph holds the collectives;
``reshard_after_forward`` runs the gather again in backward (``hooks.py``), and buffers and
prefetch are the compiler's business there.
"""
from .api import (CPUOffloadPolicy, DataParallelMeshDims, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                  UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx)
from .layouts import block_aligned, deal_largest_first, whole_parameters

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "UnshardHandle", "block_aligned", "deal_largest_first", "fully_shard", "register_fsdp_forward_method",
           "share_comm_ctx", "whole_parameters"]
