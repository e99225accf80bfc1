"""Ops on inputs with a placement no sharding rule reads (``StridedShard``, ``RaggedShard``).

An elementwise op whose tensor operands all hold one layout (position by position for the
``_foreach_`` ops; 0-d replicated scalars aside) runs on the pieces as they are: a packed or
ragged weight, its gradient and its optimizer state keep their layout through a training step
with no communication.  A sum or a norm of every element (``clip_grad_norm_``'s ``_foreach_norm``)
reduces each rank's pieces and is Partial over the mesh dims that split, again with no data
moved.  Any other op runs on its inputs with those mesh dims gathered
(``placement.rules_view``), through the normal dispatch, and what it writes is moved back into
the tensor it wrote: exact, never a guess.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from ..propagation import unflatten_call
from ..placement import NormPartial, Partial, Placement, Replicate, rules_view
from ..redistribute import redistribute_local
from ..spec import DTensorSpec
from ..tensor import DTensor

aten = torch.ops.aten
_ALSO_ELEMENTWISE = {aten.copy_.default, aten._to_copy.default, aten.fill_.Scalar, aten.fill_.Tensor,
                     aten.zero_.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
                     aten.full_like.default}
_ELEMENTWISE: dict[int, bool] = {}


def elementwise(func: Any) -> bool:
    """Whether each output element of ``func`` depends only on the same element of its operands
    (and no random stream): pointwise ops, their ``_foreach_`` forms, fills and copies."""
    r = _ELEMENTWISE.get(id(func))
    if r is None:
        ops = [func]
        name = func._schema.name.split("::")[-1]
        if name.startswith("_foreach_"):  # as its one-tensor op (out of place or in place)
            base = name[len("_foreach_"):].rstrip("_")
            packets = [getattr(aten, n) for n in (base, base + "_") if hasattr(aten, n)]
            ops = [o for p in packets for o in (getattr(p, n, None) for n in ("Tensor", "default")) if o is not None]
        r = any(op in _ALSO_ELEMENTWISE or (torch.Tag.pointwise in op.tags and
                                            torch.Tag.nondeterministic_seeded not in op.tags) for op in ops)
        _ELEMENTWISE[id(func)] = r
    return r


def _layouts(args: tuple, kwargs: dict) -> list[DTensorSpec] | None:
    """The one layout of the operands at each position (one position, or one per list element),
    or None when operands differ, are plain tensors or are Partial (elementwise ops do not
    commute with a pending sum)."""
    values = [*args, *kwargs.values()]
    lists = [v for v in values if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v)]
    singles = [v for v in values if isinstance(v, torch.Tensor)]
    n = len(lists[0]) if lists else 1
    if any(len(v) != n for v in lists):
        return None
    out = []
    for i in range(n):
        ref = None
        for t in [*(v[i] for v in lists), *singles]:
            if t is None:
                continue
            if not isinstance(t, DTensor):
                return None
            s = t._spec
            if any(p.is_partial() for p in s.placements):
                return None
            if t.ndim == 0 and all(p.is_replicate() for p in s.placements):
                continue
            if ref is None:
                ref = s
            elif (s.placements, s.shard_order, s.shape, s.mesh) != (ref.placements, ref.shard_order, ref.shape,
                                                                       ref.mesh):
                return None
        if ref is None:
            return None
        out.append(ref)
    return out


def _wrap(out: Any, layouts: list[DTensorSpec]) -> Any:
    if isinstance(out, torch.Tensor):
        return DTensor(out, layouts[0].with_dtype(out.dtype))
    if isinstance(out, (list, tuple)) and len(layouts) > 1:
        return type(out)(DTensor(o, s.with_dtype(o.dtype)) for o, s in zip(out, layouts))
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, layouts) for o in out)
    return out


_WHOLE = {aten.sum.default: "sum", aten.linalg_vector_norm.default: "norm", aten._foreach_norm.Scalar: "norm"}


def _whole_reduction(func: Any, args: tuple, kwargs: dict) -> Any:
    """A sum or norm over every element of inputs without Partials, as each rank's reduction of
    its pieces, Partial (``NormPartial``) over the mesh dims that split them; NotImplemented where
    it does not apply (a dim given, a Partial input, an infinite norm of an empty piece)."""
    kind = _WHOLE.get(func)
    if kind is None:
        return NotImplemented
    call = dict(zip(("self", "ord", "dim", "keepdim"), args), **kwargs)
    if call.get("dim") is not None or call.get("keepdim"):
        return NotImplemented
    xs = call["self"] if isinstance(call["self"], (list, tuple)) else [call["self"]]
    if not all(isinstance(x, DTensor) and not any(p.is_partial() for p in x._spec.placements) for x in xs):
        return NotImplemented
    order = float(call.get("ord", 2)) if kind == "norm" else None
    if order in (float("inf"), float("-inf")) and any(_has_empty_piece(x._spec) for x in xs):
        return NotImplemented
    first = [x._local_tensor for x in xs] if isinstance(call["self"], (list, tuple)) else xs[0]._local_tensor
    local = func(first, *args[1:], **kwargs)

    def placed(t: torch.Tensor, spec: DTensorSpec) -> DTensor:
        pl: list[Placement] = [Replicate() if p.tensor_dim() is None else NormPartial(order) if order is not None
                               else Partial("sum") for p in spec.placements]
        return DTensor(t, DTensorSpec.build(spec.mesh, pl, (), (), t.dtype))

    if isinstance(local, (list, tuple)):
        return type(local)(placed(t, x._spec) for t, x in zip(local, xs))
    return placed(local, xs[0]._spec)


def _has_empty_piece(spec: DTensorSpec) -> bool:
    return any(0 in spec.local_shape_and_offset(c)[0] for c in itertools.product(*(range(k) for k in spec.mesh.shape)))


def dispatch_opaque(func: Any, args: tuple, kwargs: dict, flat: list, specs: list, treedef, inplace: bool, redispatch: Callable[..., Any]) -> Any:
    """``func`` with inputs the rules do not read (see the module docstring); ``inplace``: it returns its self.
    A view op's results are copies (of the gathered inputs): dispatch records them so."""
    whole = _whole_reduction(func, args, kwargs)
    if whole is not NotImplemented:
        return whole
    if elementwise(func):
        layouts = _layouts(args, kwargs)
        if layouts is not None:
            local = [a._local_tensor if isinstance(a, DTensor) else a for a in flat]
            largs, lkwargs = unflatten_call(local, treedef)
            out = func(*largs, **lkwargs)
            return args[0] if inplace else _wrap(out, layouts)
    plain, versions = list(flat), {}
    for i, (a, s) in enumerate(zip(flat, specs)):
        if s is not None and s.opaque:
            read = s.with_placements(*rules_view(s.placements, s.shard_order))
            plain[i] = DTensor(redistribute_local(a._local_tensor, s, read), read)
            versions[i] = plain[i]._local_tensor._version
    pargs, pkwargs = unflatten_call(plain, treedef)
    out = redispatch(func, pargs, pkwargs)
    for i, before in versions.items():  # what the op wrote goes back into the packed tensor
        written, me = plain[i], flat[i]
        if written._spec.shape != specs[i].shape:  # it changed the shape (``resize_``): it takes the result
            me._local_tensor, me._spec = written._local_tensor, written._spec
        elif written._local_tensor._version != before:
            me._local_tensor.copy_(redistribute_local(written._local_tensor, written._spec, specs[i]))
        if out is written:
            out = me
    return out
