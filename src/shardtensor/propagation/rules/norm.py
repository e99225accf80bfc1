"""Vector norms: a sharded reduced dim becomes the p-norm partial ``PN(ord)``.

==========================================  =====================================  ==================
op                                          ``S(d in D)`` -> / Partial kept         local step
==========================================  =====================================  ==================
linalg_vector_norm(ord, dim, keepdim)       ``PN(ord)`` / ``PN(ord)`` if ord != 0    empty shard of an
norm.Scalar, norm.ScalarOpt_dim[_dtype],    same (``p=None`` means 2)               inf / negative-ord
norm.ScalarOpt_dtype                                                                norm -> identity
_foreach_norm.Scalar                        per element, all dims reduced: a 0-d    same, per element
                                            ``PN(ord)`` where the element was
                                            sharded, ``R`` where it was ``R``
==========================================  =====================================  ==================

Any other Partial input (``P(sum)``, ``PN`` of another ord, ``PN(0)``) is reduced first, to
``R`` or by a reduce-scatter to a shard, whichever the engine finds cheaper; the candidates are
the shared reduction machinery's.  The identity of an empty shard is 0 for ``ord=inf`` (norms
are >= 0) and ``+inf`` for ``ord=-inf`` and negative finite ords (``inf^ord`` adds 0).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ...placement import NormPartial, Partial
from ..call import Call, Decision
from ..registry import register
from ..strategy import finish, keep_order, kept_order, pick
from .reduction import check_dims, choices, empty_safe, out_order, out_spec, reduce_out, reduced_dims

aten = torch.ops.aten

__all__ = ["norm_partial", "norm_identity"]


def norm_partial(call: Call, ord: Any) -> NormPartial:
    """``PN(ord)``, or ``NotImplementedError`` naming the op for an unsupported ``ord``."""
    if ord is None:
        ord = 2
    try:
        return NormPartial(ord)
    except (NotImplementedError, TypeError) as e:
        raise call.refuse(f"with ord={ord!r}: {e}") from None


def norm_identity(p: float) -> float | None:
    """The local norm of an empty shard where torch raises on it (``None``: torch's value is right)."""
    if p == math.inf:
        return 0.0
    if p < 0:
        return math.inf
    return None


def _keep(pn: NormPartial) -> Callable[[Partial], bool]:
    return lambda p: pn.norm != 0 and p == pn


@register(aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype,
          aten.norm.ScalarOpt_dtype)
def vector_norm_rule(call: Call) -> Decision:
    """``S(d in D)`` -> ``PN(ord)``; ``PN(ord)`` inputs kept for ord != 0; others reduced first."""
    pos = call.pos("self")
    s = call.specs[pos]
    if call.op is aten.linalg_vector_norm.default:
        ord_ = call.arg("ord", 2)
    else:
        ord_ = call.arg("p", 2)
    if call.op in (aten.norm.Scalar, aten.norm.ScalarOpt_dtype):
        dim, keepdim = None, False
    else:
        dim, keepdim = call.arg("dim", None), bool(call.arg("keepdim", False))
    pn = norm_partial(call, ord_)
    D = reduced_dims(dim, s.ndim)
    meta = call.out_meta
    check_dims(call, s, D, keepdim, meta)
    req = pick(call, pos, choices(s, D, decomposable=True, keep=_keep(pn)))
    kernel = None
    fill = norm_identity(pn.norm)
    if fill is not None and any(p.is_shard() and p.dim in D for p in req):
        kernel = empty_safe(call.op, D, keepdim, lambda dt: fill, meta.dtype)
    out_pl = reduce_out(req, D, keepdim, pn)
    order = out_order(kept_order(s, req), out_pl, D, keepdim)
    return finish(call, {pos: req}, out_spec(call, meta, out_pl, order), kernel=kernel, order=keep_order)


@register(aten._foreach_norm.Scalar)
def foreach_norm_rule(call: Call) -> Decision:
    """One independent choice per list element; each output a 0-d ``PN(ord)``/``R`` tensor."""
    positions = call.positions("self")
    if any(p is None for p in positions):
        raise call.refuse("with a list mixing DTensors and plain tensors")
    pn = norm_partial(call, call.arg("ord", 2))
    metas = call.out_meta
    required = {}
    outs = []
    for pos, meta in zip(positions, metas):
        s = call.specs[pos]
        D = tuple(range(s.ndim))
        req = pick(call, pos, choices(s, D, decomposable=True, keep=_keep(pn)))
        required[pos] = req
        outs.append(out_spec(call, meta, reduce_out(req, D, False, pn), ()))
    dtypes = [m.dtype for m in metas]
    return finish(call, required, type(metas)(outs), kernel=_foreach_kernel(pn.norm, dtypes), order=keep_order)


def _foreach_kernel(p: float, dtypes: Sequence[torch.dtype]) -> Callable:
    """Kernel: per-tensor vector norms, the identity for empty tensors where torch raises."""
    fill = norm_identity(p)

    def kernel(tensors: Sequence[torch.Tensor], ord: Any = 2, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        if fill is None or all(t.numel() for t in tensors):  # one foreach kernel: no empty piece to fill
            norms = torch._foreach_norm(list(tensors), p, dtype=dtype)
            return [r if r.dtype is dt else r.to(dt) for r, dt in zip(norms, dtypes)]
        out = []
        for t, dt in zip(tensors, dtypes):
            if t.numel() == 0 and fill is not None:
                out.append(torch.full((), fill, dtype=dt, device=t.device))
            else:
                out.append(torch.linalg.vector_norm(t, p, dtype=dtype).to(dt))
        return out

    return kernel
