"""Ops on inputs with a placement no sharding rule reads (``StridedShard``, ``RaggedShard``).

An elementwise op whose tensor operands all hold one layout (position by position for the
``_foreach_`` ops; 0-d replicated scalars aside) runs on the pieces as they are: a packed or
ragged weight, its gradient and its optimizer state keep their layout through a training step
with no communication.  A sum or a norm of every element (``clip_grad_norm_``'s ``_foreach_norm``)
reduces each rank's pieces and is Partial over the mesh dims that split, again with no data
moved; a reduction, scan or softmax along dims that no placement splits runs on the pieces and
keeps the layout.  Any other op runs on its inputs with those mesh dims gathered
(``placement.rules_view``), through the normal dispatch, and what it writes is moved back into
the tensor it wrote: exact, never a guess.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from ..propagation import unflatten_call
from ..placement import NormPartial, Partial, Placement, Replicate, rules_view, split_local
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
    commute with a pending sum).  A replicated operand agrees with any layout: a 0-d one as it
    is, one of the layout's shape cut to each rank's piece (``_local``)."""
    values = [*args, *kwargs.values()]
    lists = [v for v in values if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v)]
    singles = [v for v in values if isinstance(v, torch.Tensor)]
    n = len(lists[0]) if lists else 1
    if any(len(v) != n for v in lists):
        return None
    out = []
    for i in range(n):
        ts = [(t, True) for v in lists if (t := v[i]) is not None] + [(t, False) for t in singles]
        if not all(isinstance(t, DTensor) and not any(p.is_partial() for p in t._spec.placements) for t, _ in ts):
            return None
        laid = [t._spec for t, _ in ts if not _replicated(t._spec)]
        ref = laid[0] if laid else next((t._spec for t, _ in ts if t.ndim), None)
        if ref is None:
            return None
        for t, listed in ts:
            s = t._spec
            if (s.placements, s.shard_order, s.shape, s.mesh) == (ref.placements, ref.shard_order, ref.shape, ref.mesh):
                continue
            if not _replicated(s) or (s.ndim and not (s.mesh == ref.mesh and s.shape == ref.shape and (listed or n == 1)
                                                      and ref.mesh.get_coordinate() is not None)):
                return None
        out.append(ref)
    return out


def _written(func: Any, args: tuple, kwargs: dict) -> list[DTensor]:
    """The DTensor operands ``func``'s schema says it writes (in place, ``out=``)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            out += [x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, DTensor)]
    return out


def _replicated(spec: DTensorSpec) -> bool:
    return all(p.is_replicate() for p in spec.placements)


def _local(a: Any, layout: DTensorSpec) -> Any:
    """An operand's local tensor in ``layout``: its own, or each rank's cut of a replicated one."""
    if not isinstance(a, DTensor):
        return a
    s = a._spec
    if s is layout or not s.ndim or not _replicated(s) or _replicated(layout):
        return a._local_tensor
    coord = layout.mesh.get_coordinate()
    assert coord is not None  # (_layouts cuts only on ranks of the mesh)
    return split_local(a._local_tensor, layout.mesh.shape, coord, layout.placements, layout.shard_order)


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


# ops that reduce or scan along the dims named by their ``dim`` argument, each output element
# reading only elements that agree with it on every other dim; True: the output keeps every dim
# (a scan, a softmax), False: it follows ``keepdim``
_ALONG: dict[Any, bool] = {
    aten.sum.dim_IntList: False, aten.mean.dim: False, aten.amax.default: False, aten.amin.default: False,
    aten.prod.dim_int: False, aten.var.correction: False, aten.std.correction: False,
    aten.linalg_vector_norm.default: False, aten.logsumexp.default: False, aten.argmax.default: False,
    aten.argmin.default: False, aten.any.dim: False, aten.all.dim: False, aten.any.dims: False,
    aten.all.dims: False, aten.cumsum.default: True, aten.cumprod.default: True,
    aten._softmax.default: True, aten._log_softmax.default: True, aten._softmax_backward_data.default: True,
    aten._log_softmax_backward_data.default: True,
}


def _along_dims(func: Any, args: tuple, kwargs: dict) -> Any:
    """A reduction or scan along dims that no placement splits, on operands of one layout: each
    rank's pieces hold whole rows along those dims, so it runs on them as they are and the result
    keeps the layout (its dims renumbered where a reduction drops them).  NotImplemented where it
    does not apply (every dim, a split dim, operands of other layouts)."""
    keep = _ALONG.get(func)
    if keep is None:
        return NotImplemented
    call = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    layouts = _layouts(args, kwargs)
    dim = call.get("dim")
    if layouts is None or len(layouts) != 1 or dim is None or dim == [] or not layouts[0].ndim:
        return NotImplemented
    spec = layouts[0]
    n = spec.ndim
    dims = {d % n for d in ((dim,) if isinstance(dim, int) else dim)}
    if any(p.tensor_dim() in dims for p in spec.placements):
        return NotImplemented
    largs, lkwargs = [_local(a, spec) for a in args], {k: _local(v, spec) for k, v in kwargs.items()}
    if largs[0].numel() == 0:  # an empty piece: its shape from the meta kernel (var/std would warn of no data)
        meta = func(*(_meta(a) for a in largs), **{k: _meta(v) for k, v in lkwargs.items()})
        out = torch.empty(meta.shape, dtype=meta.dtype, device=largs[0].device)
    else:
        out = func(*largs, **lkwargs)
    if keep or call.get("keepdim"):
        shape = tuple(1 if d in dims and not keep else spec.shape[d] for d in range(n))
        new = list(range(n))
    else:
        shape = tuple(spec.shape[d] for d in range(n) if d not in dims)
        new = [d - sum(e < d for e in dims) for d in range(n)]
    pl = [p if (d := p.tensor_dim()) is None else p.on_dim(new[d]) for p in spec.placements]
    order = tuple((new[d], js) for d, js in spec.shard_order)
    return DTensor(out, DTensorSpec.build(spec.mesh, pl, shape, None, out.dtype, order))


def _meta(a: Any) -> Any:
    return a.to("meta") if isinstance(a, torch.Tensor) else a


def _has_empty_piece(spec: DTensorSpec) -> bool:
    return any(0 in spec.local_shape_and_offset(c)[0] for c in itertools.product(*(range(k) for k in spec.mesh.shape)))


def dispatch_opaque(func: Any, args: tuple, kwargs: dict, flat: list, specs: list, treedef, inplace: bool, redispatch: Callable[..., Any]) -> Any:
    """``func`` with inputs the rules do not read (see the module docstring); ``inplace``: it returns its self.
    A view op's results are copies (of the gathered inputs): dispatch records them so."""
    for local_op in (_whole_reduction, _along_dims):
        done = local_op(func, args, kwargs)
        if done is not NotImplemented:
            return done
    if elementwise(func):
        layouts = _layouts(args, kwargs)
        if layouts is not None and not any(_replicated(w._spec) and not _replicated(layouts[0])
                                           for w in _written(func, args, kwargs)):
            # (a written operand is never a cut: the op would write only each rank's piece of it)
            def local(v: Any) -> Any:  # a list's element i in layout i (a foreach op), any other operand in the first
                if isinstance(v, (list, tuple)) and len(v) == len(layouts):
                    return type(v)(_local(x, s) for x, s in zip(v, layouts))
                return _local(v, layouts[0])

            out = func(*(local(v) for v in args), **{k: local(v) for k, v in kwargs.items()})
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
