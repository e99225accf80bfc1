"""Fourier transforms: the dims an FFT does not transform keep their shards.

``_fft_r2c``, ``_fft_c2c``, ``_fft_c2r`` (what every ``torch.fft`` function reaches) transform the
dims in ``dim``; every other dim is a batch of independent transforms.  Required input: shards
of the transformed dims gathered, the rest kept; ``P(sum)``/``P(avg)`` kept (a transform is
linear).  Output: the same placements (the transformed dims change length, never rank).
"""
from __future__ import annotations

import torch

from ..call import Call, Decision
from ..registry import register
from ..strategy import finish, linear_partial
from .misc import _empty_safe, _ops, _renumbered, cheapest_gather

aten = torch.ops.aten


@register(*_ops(["_fft_r2c", "_fft_c2c", "_fft_c2r"]))
def fft_rule(call: Call) -> Decision:
    """Transformed dims gathered, batch dims kept, linear partials kept."""
    s = call.specs[0]
    dims = {d % s.ndim for d in call.arg("dim")}
    req = cheapest_gather(call, 0, lambda d: d not in dims, linear_partial)
    out = _renumbered(req, {d: d for d in range(s.ndim)}, call.out_meta)
    return finish(call, {0: req}, out, kernel=_empty_safe(call.op, out))  # MKL refuses an empty batch piece
