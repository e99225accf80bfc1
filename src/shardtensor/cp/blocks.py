"""Attention of one query block against one key/value block, with its log-sum-exp, and its backward.

Ring attention computes softmax attention block by block: each block gives its output and the
log-sum-exp of its scores, and ``merge`` combines two blocks' results exactly (the softmax of the
union).  The backward of a block needs only the *final* output and log-sum-exp of its query rows:
``P = exp(S - lse)`` is then the block's part of the global softmax, so block gradients add up to
the gradients of the whole.

The math here runs on every device and dtype (scores in float32, float64 for float64 inputs): it
is the block kernel everywhere, so ring results do not depend on which fused kernel a backend has.
Grouped-query attention (``enable_gqa``) views the query heads as ``(kv_heads, group)`` against
broadcast keys, so keys and values are never repeated.
"""
from __future__ import annotations

import torch

__all__ = ["acc_dtype", "block_forward", "block_backward", "merge", "grouped", "ungrouped"]


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
