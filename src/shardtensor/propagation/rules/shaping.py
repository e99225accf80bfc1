"""Complex views and constant padding: ops rotary embeddings and convolutions' callers use.

| op | required | output |
|---|---|---|
| ``view_as_complex`` | ``S`` on the last dim (the 2 parts) gathered; ``P(sum)``/``P(avg)`` kept (linear), other partials reduced | every other ``S`` kept; complex dtype |
| ``view_as_real`` | as is (linear partials kept) | ``S`` kept; a new last dim of 2 |
| ``_conj`` (``conj``) | as is (linear partials kept) | as is; the local result is ``conj_physical`` (a copy: a wrapper tensor carries no conjugate bit) |
| ``constant_pad_nd`` (``F.pad``) | ``S`` on a padded dim gathered; partials kept where every rank's padding reduces to the value (0 for sum/avg, any for max/min) | input's placements |
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ...placement import Placement
from ..call import Call, Decision
from ..registry import register
from ..strategy import linear_partial
from .view import follow

aten = torch.ops.aten

__all__ = ["view_as_complex_rule", "view_as_real_rule", "conj_rule", "constant_pad_rule"]


def _as_complex(x: torch.Tensor) -> torch.Tensor:
    """A gathered last dim may arrive with another layout: make it viewable first (a fresh
    copy: ``contiguous`` keeps an empty piece's strides)."""
    if x.stride(-1) != 1 or any(s % 2 for s in x.stride()[:-1]):
        x = x.new_empty(x.shape).copy_(x)
    return torch.view_as_complex(x)


@register(aten.view_as_complex.default)
def view_as_complex_rule(call: Call) -> Decision:
    nd = call.specs[0].ndim
    return follow(call, 0, {d: d for d in range(nd - 1)}, call.out_meta, partial_ok=linear_partial, kernel=_as_complex)


@register(aten.view_as_real.default)
def view_as_real_rule(call: Call) -> Decision:
    nd = call.specs[0].ndim
    return follow(call, 0, {d: d for d in range(nd)}, call.out_meta, partial_ok=linear_partial)


def _conj_kernel(x: torch.Tensor) -> torch.Tensor:
    return torch.conj_physical(x)


@register(aten._conj.default)
def conj_rule(call: Call) -> Decision:
    nd = call.specs[0].ndim
    d = follow(call, 0, {d: d for d in range(nd)}, call.out_meta, partial_ok=linear_partial, kernel=_conj_kernel)
    return replace(d, copies=True)


@register(aten.constant_pad_nd.default)
def constant_pad_rule(call: Call) -> Decision:
    """Padding runs locally once every padded dim is whole on each rank."""
    s = call.specs[0]
    pad = list(call.arg("pad"))
    value = call.arg("value", 0)
    padded = {s.ndim - 1 - i // 2 for i, n in enumerate(pad) if n != 0}

    def partial_ok(p: Placement) -> bool:
        op = p.plain_op()
        return op in ("max", "min") or (value == 0 and op in ("sum", "avg"))

    return follow(call, 0, {d: d for d in range(s.ndim)}, call.out_meta, gather=sorted(padded),
                  partial_ok=partial_ok)
