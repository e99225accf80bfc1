"""Scaled dot-product attention: shard the batch or the heads dim, forward and backward.

``F.scaled_dot_product_attention`` reaches dispatch as one fused op per backend (the CPU flash
kernel, CUDA flash / memory-efficient / cuDNN) with its backward.  Every query row of every
(batch, head) pair is independent, so per mesh dim the candidates are:

| candidate | (batch, heads, ...) tensors | other tensors (masks that broadcast, RNG state) |
|---|---|---|
| replicate | `R` | `R` |
| shard batch | `S(0)` | `R` (`S(0)` where the tensor has the full batch dim) |
| shard heads | `S(1)` | as above on dim 1; only when every 4-D operand has the same heads (no GQA) |

Partial inputs are reduced first (attention is not linear).  Dropout inside attention draws
random numbers per element, which the sharded kernels would draw per rank: refused.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

from ...placement import Placement, Replicate, Shard
from ..call import Call, Decision
from ..registry import register
from ..strategy import Candidate, decide

aten = torch.ops.aten

_NAMES = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
          "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
          "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")
OPS = [getattr(aten, n).default for n in _NAMES if hasattr(aten, n)]


def _follows(shape: Any, ref: tuple[int, ...], dim: int) -> bool:
    """Whether a tensor of ``shape`` carries the reference's (batch, heads) dim ``dim`` in full."""
    return len(shape) > dim and len(shape) >= 2 and tuple(shape[:dim + 1]) == ref[:dim + 1]


def _placement(shape: Any, ref: tuple[int, ...], p: Placement) -> Placement:
    return p if p.is_shard() and _follows(shape, ref, p.dim) else Replicate()


@register(*OPS)
def attention_rule(call: Call) -> Decision:
    """Batch or heads sharded alike in every (batch, heads, ...) operand and output."""
    dropout = call.arg("dropout_p", 0.0)
    if isinstance(dropout, (int, float)) and dropout > 0:
        raise call.refuse(f"with dropout_p={dropout} (random per element)")
    pos = call.tensor_positions
    first = call.specs[pos[0]]
    if first.ndim < 3:
        raise call.refuse("with operands of fewer than 3 dims")
    ref = tuple(first.shape[:2])
    four_d = [call.specs[i].shape for i in pos if call.specs[i].ndim == 4]
    options: list[Placement] = [Replicate(), Shard(0)]
    if all(s[1] == ref[1] for s in four_d):
        options.append(Shard(1))
    meta = call.out_meta
    outs = list(meta) if isinstance(meta, (tuple, list)) else [meta]
    cands = []
    for combo in itertools.product(options, repeat=call.mesh.ndim):
        inputs = {i: tuple(_placement(call.specs[i].shape, ref, p) for p in combo) for i in pos}
        out = [tuple(_placement(o.shape, ref, p) for p in combo) if isinstance(o, torch.Tensor) else None
               for o in outs]
        cands.append(Candidate(inputs, type(meta)(out) if isinstance(meta, (tuple, list)) else out[0]))
    return decide(call, cands, kernel=_empty_safe(call.op))


def _empty_safe(op: Any) -> Any:
    """Kernel: the op on contiguous local tensors, or (for a rank whose batch or heads shard is
    empty) empty outputs of the right local shapes.

    The fused kernels rely on layouts that ``F.scaled_dot_product_attention`` checked on the
    global tensors (a unit last stride); a redistributed shard may have another.  torch's fused
    CPU kernel also divides by zero on an empty batch.
    """
    def kernel(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        if not any(isinstance(a, torch.Tensor) and a.ndim >= 3 and a.numel() == 0 for a in args):
            return op(*args, **kwargs)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        meta = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args],
                  **{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
        return type(meta)(torch.zeros(m.shape, dtype=m.dtype, device=device) if isinstance(m, torch.Tensor) else m
                          for m in meta)
    return kernel

