"""Activation checkpointing over ``fully_shard`` blocks trains as without it.

Non-reentrant checkpointing recomputes a block's forward inside backward and stops it as soon as
the saved tensors are back, before the block's forward hook: FSDP's hook that puts the sharded
parameters back never ran, so after backward the block's parameters were its unsharded plain
tensors, without gradients (``model.parameters()`` and a state dict saw the wrong tensors).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from shardtensor import DTensor, init_device_mesh, run_spmd
from shardtensor.comm import current_transport
from shardtensor.examples.tiny_lm import VOCAB, batch, build_model, tp_plan
from shardtensor.fsdp import fully_shard
from shardtensor.parallel import parallelize_module


class Checkpointed(nn.Module):
    """The demo model's forward with each block under ``torch.utils.checkpoint``."""

    def __init__(self, lm: nn.Module, reentrant: bool | None) -> None:
        super().__init__()
        self.lm, self.reentrant = lm, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lm = self.lm
        h = lm.tok(x) + lm.pos(torch.arange(x.shape[1]))
        for blk in lm.blocks:
            h = blk(h) if self.reentrant is None else checkpoint(blk, h, use_reentrant=self.reentrant)
        return lm.head(lm.ln_f(h))


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _dp_mesh(m: nn.Module, two_d: bool):
    """The dp mesh for ``fully_shard`` (after TP on ``m``'s blocks for 2-D) and this rank's data seed."""
    world, rank = current_transport().world_size, current_transport().rank
    if not two_d:
        return init_device_mesh("cpu", (world,)), rank
    parent = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    for blk in m.blocks:
        parallelize_module(blk, parent["tp"], tp_plan())
    return parent["dp"], rank // 2


def _steps_agree(forwards: list, models: list[nn.Module], params, seed: int) -> list[bool]:
    """Two SGD steps of both models (``forwards`` run them) on the same data: after each backward
    every parameter of ``params(model)`` is a sharded DTensor with a gradient, and the two
    models' gradients agree."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    ok = []
    for step in range(2):
        x, y = batch(step, seed)
        for f in forwards:
            nn.functional.cross_entropy(f(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        ps = [params(m) for m in models]
        ok.append(all(isinstance(p, DTensor) and p.grad is not None for pl in ps for p in pl))
        ok.append(all(torch.allclose(_whole(p.grad), _whole(q.grad), atol=1e-6) for p, q in zip(*ps)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return ok


def _train(reentrant: bool, two_d: bool) -> list:
    """Two steps with and without checkpointing: after each backward every parameter of both is a
    sharded DTensor, and the gradients and the updated parameters agree."""
    models = [build_model(0) for _ in range(2)]
    for m in models:
        mesh, seed = _dp_mesh(m, two_d)
        for blk in m.blocks:
            fully_shard(blk, mesh=mesh)
    wrapped = [Checkpointed(models[0], reentrant), Checkpointed(models[1], None)]
    ok = _steps_agree(wrapped, models, lambda m: list(m.blocks.parameters()), seed)
    with torch.no_grad():
        ok.append(all(torch.allclose(_whole(p), _whole(q), atol=1e-6)
                      for p, q in zip(models[0].parameters(), models[1].parameters())))
    return ok


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("two_d", [False, True], ids=["fsdp", "fsdp_x_tp"])
def test_checkpointed_fsdp_blocks_train_like_plain_ones(reentrant, two_d):
    assert run_spmd(_train, 4, reentrant, two_d) == [[True] * 5] * 4


def _policy(ctx, op, *args, **kwargs):
    """torchtitan's selective policy in small: matmul outputs are saved, the rest recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    save = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def _train_wrapped(kind: str, two_d: bool) -> list:
    """torchtitan's memory recipe: each block in ``checkpoint_wrapper`` (full, or selective with a
    ``create_selective_checkpoint_contexts`` policy), ``fully_shard`` on each wrapped block, then
    on the root; two steps against the same model without checkpointing."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    models = [build_model(0) for _ in range(2)]
    for i, m in enumerate(models):
        mesh, seed = _dp_mesh(m, two_d)
        for j, blk in enumerate(list(m.blocks)):
            if i == 0:
                ctx = {} if kind == "full" else {"context_fn": functools.partial(create_selective_checkpoint_contexts,
                                                                                  _policy)}
                blk = m.blocks[j] = checkpoint_wrapper(blk, **ctx)
            fully_shard(blk, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return _steps_agree(models, models, lambda m: list(m.parameters()), seed)


@pytest.mark.parametrize("kind", ["full", "selective"])
@pytest.mark.parametrize("two_d", [False, True], ids=["fsdp", "fsdp_x_tp"])
def test_checkpoint_wrapped_blocks_under_fully_shard_train_like_plain_ones(kind, two_d):
    """The wrapper's recompute runs the inner block, which no FSDP hook precedes: the block must
    compute with its unsharded parameters (it saw the sharded ones and raised)."""
    assert run_spmd(_train_wrapped, 4, kind, two_d) == [[True] * 4] * 4
