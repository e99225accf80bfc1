"""Attention of one query block against one key/value block, with its log-sum-exp, and its backward.

Ring attention computes softmax attention block by block: each block gives its output and the
log-sum-exp of its scores, and ``merge`` combines two blocks' results exactly (the softmax of the
union).  The backward of a block needs only the *final* output and log-sum-exp of its query rows:
``P = exp(S - lse)`` is then the block's part of the global softmax, so block gradients add up to
the gradients of the whole.

Two kernels: torch's fused CPU flash kernel (``fused``: float32/float64 on CPU, one head dim,
no grouped heads) for full and causal-triangle blocks, and plain math everywhere else (scores in
float32, float64 for float64 inputs; any device, dtype and mask).  Grouped-query attention
(``enable_gqa``) views the query heads as ``(kv_heads, group)`` against broadcast keys, so keys and
values are never repeated.
"""
from __future__ import annotations

import torch

from .layout import Pair

__all__ = ["acc_dtype", "block_forward", "block_backward", "merge", "grouped", "ungrouped", "fusable", "attend",
           "attend_backward"]

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and partial results are kept in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(B, H, L, D)`` queries as ``(B, Hkv, H/Hkv, L, D)`` (query head ``h`` reads kv head ``h // g``)."""
    b, h, n, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, n, d)


def ungrouped(x: torch.Tensor) -> torch.Tensor:
    """Inverse of ``grouped`` (for outputs and query gradients)."""
    b, hk, g = x.shape[:3]
    return x.reshape(b, hk * g, *x.shape[3:])


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of ``q`` against this block; rows that see nothing get ``lse = -inf``
    and a zero output.  Inputs are already in the accumulation dtype."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, v), lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(torch.isinf(lse), 0.0)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, o: torch.Tensor,
          lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax attention of the union of two key sets, from each set's (output, lse)."""
    if out is None or lse is None:
        return o, lo
    new = torch.logaddexp(lse, lo)
    safe = _finite(new)
    w_old = torch.exp(lse - safe).masked_fill(torch.isinf(new), 0.0).unsqueeze(-1)
    w_new = torch.exp(lo - safe).masked_fill(torch.isinf(new), 0.0).unsqueeze(-1)
    return out * w_old + o * w_new, new


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   lse: torch.Tensor, dout: torch.Tensor,
                   delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of (dq, dk, dv), given the final ``lse`` and ``delta = rowsum(dout * out)``.
    ``dk``/``dv`` come back in ``k``/``v``'s (broadcast) shape."""
    p = torch.exp(_scores(q, k, mask, scale) - _finite(lse).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, dk.sum_to_size(k.shape), dv.sum_to_size(v.shape)


def fusable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's fused CPU kernel can compute blocks of these (ungrouped) tensors exactly."""
    return (_FLASH is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and q.dtype == k.dtype == v.dtype and q.shape[-1] == v.shape[-1] and q.ndim == k.ndim)


def _triangle(pair: Pair, device: torch.device) -> torch.Tensor | None:
    if pair.mask is not None:
        return pair.mask.to(device)
    if pair.causal:
        n = pair.qs.stop - pair.qs.start
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pair: Pair, scale: float,
           fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, lse) of one pair of runs (``q``, ``k``, ``v`` already cut to them)."""
    if fused and pair.mask is None:
        out, lse = _FLASH(q, k, v, 0.0, pair.causal, scale=scale)  # type: ignore[misc]
        return out, lse
    return block_forward(q, k, v, _triangle(pair, q.device), scale)


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pair: Pair, scale: float, fused: bool,
                    out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                    delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pair's share of (dq, dk, dv) given the final ``out`` and ``lse`` of its query rows."""
    if fused and pair.mask is None:
        return _FLASH_BACKWARD(dout, q, k, v, out, lse, 0.0, pair.causal, scale=scale)  # type: ignore[misc,no-any-return]
    return block_backward(q, k, v, _triangle(pair, q.device), scale, lse, dout, delta)
