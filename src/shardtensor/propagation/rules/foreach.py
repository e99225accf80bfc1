"""Foreach ops and fused optimizers: one decision entry per list element.

A foreach op is its element op applied at each list index, so its decision is built from the
element op's own rule (the pointwise rule, ``copy_``, ``zero_``), one element at a time:

| foreach op (and its in-place ``_``-form) | element op | per element |
|---|---|---|
| unary ``_foreach_neg/sqrt/reciprocal/abs/exp/...`` | ``aten.<op>.default`` | pointwise: R/S pass; partials only through ``neg`` (sum/avg) |
| ``_foreach_add/sub/mul/div .List/.Tensor`` | ``add.Tensor`` ... | pointwise binary: add/sub keep matching ``P(sum)``/``P(avg)``; mul/div keep one ``P(sum|avg)`` factor (numerator) |
| ``_foreach_add/sub/mul/div .Scalar/.ScalarList`` | ``add.Scalar`` ... | mul/div keep ``P(sum|avg)``; add/sub of a scalar reduce partials first |
| ``_foreach_maximum/minimum/clamp_min/clamp_max`` | ``maximum`` / ``clamp_min`` ... | pointwise, partials reduced |
| ``_foreach_addcmul/addcdiv .Scalar/.ScalarList`` | ``addcmul`` / ``addcdiv`` | pointwise, partials reduced |
| ``_foreach_pow .List/.Scalar/.ScalarList/.ScalarAndTensor`` | ``pow.*`` | pointwise, partials reduced (exponents follow the base) |
| ``_foreach_lerp .List/.Scalar/.ScalarList`` | ``lerp.*`` | pointwise, partials reduced |
| ``_foreach_copy_`` / ``_foreach_zero_`` | ``copy_`` / ``zero_`` | src moves to self's placements / any placement |
| ``_fused_adam(w)``, ``_fused_adam(w)_``, ``_fused_sgd(_)`` | -- | every list moves to the params' placements; ``state_steps``, ``grad_scale``, ``found_inf``, a tensor ``lr`` must be R; params never Partial; an empty ``max_exp_avg_sqs`` / momentum list gives an empty output list |

A tensor argument shared by all elements (``other`` of ``.Tensor``) must get one placement:
elements that disagree raise.  In-place forms never move ``self`` (its local tensors are
written): the other operands are first aligned to ``self`` (same shards, Replicate where they
broadcast; a matching Partial kept only for add/sub), and if ``self`` would still have to
change (e.g. ``sqrt_`` of a ``P(sum)`` list) the op raises naming the element.  For
``_fused_adam(w)_`` and ``_fused_sgd_`` the mutated state lists must already match the params (momentum
buffers that do not make ``_fused_sgd_`` decompose into foreach ops); the grads may move
(they are read-only for the kernel unless ``grad_scale`` is given -- that combination raises,
since the in-place unscale of a redistributed grad would be lost).

In-place foreach ops and ``_fused_*_`` return nothing: their decision's output is ``None``.
"""
from __future__ import annotations

from typing import Any, Callable

import functools

import torch
from torch.utils._pytree import tree_flatten

from ...errors import PropagationError
from ...placement import Placement, Replicate, Shard
from ...spec import DTensorSpec
from ..call import Call, Decision, unflatten_call
from ..registry import register, rule_for
from ..strategy import decide, finish
from .pointwise import PARTIAL_ROWS

aten = torch.ops.aten

__all__ = ["foreach_rule", "fused_optimizer_rule", "FOREACH_OPS", "FUSED_OPS"]

UNARY = ["abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor", "frac",
         "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign",
         "sin", "sinh", "sqrt", "tan", "tanh", "trunc"]
ARITH = ["add", "sub", "mul", "div"]
CLAMPS = {"maximum": "clamp_min", "minimum": "clamp_max", "clamp_min": "clamp_min", "clamp_max": "clamp_max"}
ELEMENT_BY_OVERLOAD: dict[str, dict[str, Any]] = {
    "List": {**{n: f"{n}.Tensor" for n in ARITH}, "maximum": "maximum.default", "minimum": "minimum.default",
             "clamp_min": "clamp_min.Tensor", "clamp_max": "clamp_max.Tensor", "pow": "pow.Tensor_Tensor",
             "lerp": "lerp.Tensor"},
    "Scalar": {**{n: f"{n}.Scalar" for n in ARITH}, **{n: f"{c}.default" for n, c in CLAMPS.items()},
               "pow": "pow.Tensor_Scalar", "lerp": "lerp.Scalar", "addcmul": "addcmul.default",
               "addcdiv": "addcdiv.default"},
    "Tensor": {n: f"{n}.Tensor" for n in ARITH},
    "ScalarAndTensor": {"pow": "pow.Scalar"},
}
ELEMENT_BY_OVERLOAD["ScalarList"] = ELEMENT_BY_OVERLOAD["Scalar"]
NATIVE_INPLACE = {aten.copy_.default, aten.zero_.default}


def _resolve(qual: str) -> Any:
    name, overload = qual.split(".")
    return getattr(getattr(aten, name), overload)


def _element_op(op) -> Any:
    """The single-tensor op a foreach op applies per element (out-of-place form, except copy_/zero_)."""
    name = op._schema.name.split("::")[-1]
    base = name[len("_foreach_"):].rstrip("_")
    if base in ("copy", "zero"):
        return getattr(aten, base + "_").default
    overload = op._overloadname
    if overload == "default":
        return getattr(aten, base).default
    qual = ELEMENT_BY_OVERLOAD.get(overload, {}).get(base)
    if qual is None:
        return None
    return _resolve(qual)


def _is_void(op) -> bool:
    return len(op._schema.returns) == 0


def _aligned(self_spec: DTensorSpec, other: DTensorSpec, keep_partial: bool) -> DTensorSpec:
    """``other`` placed like ``self`` (in-place ops cannot move ``self``)."""
    shift = self_spec.ndim - other.ndim
    pl: list[Placement] = []
    for p, q in zip(self_spec.placements, other.placements):
        if p.is_shard():
            d = p.dim - shift
            ok = d >= 0 and other.shape[d] == self_spec.shape[p.dim]
            pl.append(Shard(d) if ok else Replicate())
        elif p.is_partial() and keep_partial and q == p:
            pl.append(q)
        else:
            pl.append(Replicate())
    order = []
    for d, js in self_spec.shard_order:
        keep = tuple(j for j in js if pl[j] == Shard(d - shift))
        if keep:
            order.append((d - shift, keep))
    return other.with_placements(pl, tuple(order))


def _element_calls(call: Call, elem_op) -> list[tuple[list[int], Call]]:
    """Per list index: (foreach flat positions of the element's leaves, the element Call)."""
    idx_args, idx_kwargs = unflatten_call(list(range(len(call.flat))), call.treedef)
    schema = call.op._schema.arguments
    values: list[tuple[Any, bool, Any]] = []
    n = None
    for i, a in enumerate(schema):
        if a.name == "out":
            continue
        if i < len(idx_args):
            v = idx_args[i]
        elif a.name in idx_kwargs:
            v = idx_kwargs[a.name]
        else:
            values.append((a, False, None))
            continue
        is_list = isinstance(v, (list, tuple))
        if is_list:
            if n is None:
                n = len(v)
            elif len(v) != n:
                raise PropagationError(f"shardtensor: {call.op}: list arguments differ in length ({n} and {len(v)})")
        values.append((a, True, v))
    elem_schema = elem_op._schema.arguments
    out = []
    for k in range(n or 0):
        eargs: list[Any] = []
        ekwargs: dict[str, Any] = {}
        for (a, present, v), ea in zip(values, elem_schema):
            if not present:
                continue
            v = v[k] if isinstance(v, (list, tuple)) else v
            if ea.kwarg_only:
                ekwargs[ea.name] = v
            else:
                eargs.append(v)
        leaves, etree = tree_flatten((tuple(eargs), ekwargs))
        out.append((leaves, Call(elem_op, [call.flat[p] for p in leaves], [call.specs[p] for p in leaves], etree)))
    return out


class _Conflict(Exception):
    pass


def foreach_rule(call: Call) -> Decision:
    """Decision of a foreach op from its element op's rule at every list index.

    A tensor shared by all elements (``other`` of ``.Tensor``) whose elements disagree is
    retried as Replicate, then (out-of-place only) with every Partial list element reduced.
    """
    elem_op = _element_op(call.op)
    if elem_op is None:
        raise call.refuse("has no element op known to shardtensor")
    rule = rule_for(elem_op)
    if rule is None:
        raise call.refuse(f"(element op {elem_op} has no sharding rule)")
    elements = _element_calls(call, elem_op)
    seen: set[int] = set()
    shared: set[int] = set()
    for leaves, _ in elements:
        for pos in set(leaves):
            if call.specs[pos] is not None:
                (shared if pos in seen else seen).add(pos)
    last = None
    for attempt in range(3 if shared else 1):
        try:
            return _foreach_decision(call, elem_op, rule, elements, shared, attempt)
        except _Conflict as e:
            last = e
    raise call.refuse(str(last))


def _foreach_decision(call: Call, elem_op, rule, elements, shared: set[int], attempt: int) -> Decision:
    inplace = _is_void(call.op) or call.op._schema.name.endswith("_")
    required: dict[int, DTensorSpec] = {}
    outputs: list[DTensorSpec | None] = []
    local_fns: list[tuple[list[int], Callable]] = []
    for k, (leaves, ecall0) in enumerate(elements):
        specs = list(ecall0.specs)
        for e, pos in enumerate(leaves):
            s = specs[e]
            if s is None:
                continue
            if (attempt >= 1 and pos in shared) or (attempt >= 2 and not inplace):
                specs[e] = s.unpartial()
        ecall = Call(elem_op, ecall0.flat, specs, ecall0.treedef)
        self_spec = call.specs[leaves[0]] if leaves else None
        if inplace and self_spec is None:
            raise call.refuse(f"writes into a plain tensor at index {k}")
        if inplace and elem_op not in NATIVE_INPLACE:
            keep = PARTIAL_ROWS.get(elem_op) == "terms"
            ecall.specs = [s if e == 0 or s is None else _aligned(self_spec, s, keep) for e, s in enumerate(ecall.specs)]
        d = rule(ecall)
        if not isinstance(d, Decision):
            d = decide(ecall, d)
        if d.kernel is not None:
            raise call.refuse(f"(element op {elem_op} needs a custom kernel)")
        if inplace:
            out = d.output
            want = d.inputs[0] if d.inputs[0] is not None else self_spec
            if want != self_spec or (out is not None and (out.placements != self_spec.placements
                                                           or out.shard_order != self_spec.shard_order)):
                got = out.placements if out is not None else want.placements
                raise PropagationError(
                    f"shardtensor: {call.op}: in-place on element {k} with placements {self_spec.placements} would "
                    f"need placements {got}; redistribute self or use the out-of-place op")
        else:
            outputs.append(d.output)
        parts: list[tuple[int, int, Placement]] = []
        for e, pos in enumerate(leaves):
            want = d.inputs[e]
            if call.specs[pos] is None or want is None:
                continue
            want, moved_parts = _partition_locally(call.specs[pos], want)
            if moved_parts and pos in shared:
                raise _Conflict(f"(the shared tensor argument would have to become {want.placements} "
                                "for one element only)")
            parts += [(e, j, q) for j, q in moved_parts]
            have = required.get(pos)
            if have is not None and have != want:
                raise _Conflict(f"(a shared tensor argument needs {have.placements} for one element and "
                                f"{want.placements} for another)")
            required[pos] = want
        if d.local_args is not None:
            local_fns.append((leaves, d.local_args))
        if parts:
            local_fns.append((leaves, _partitioner(parts, call.mesh)))
    return finish(call, required, None if inplace else list(outputs),
                  local_args=_compose(local_fns) if local_fns else None)


def _partition_locally(have: DTensorSpec, want: DTensorSpec) -> tuple[DTensorSpec, list[tuple[int, Placement]]]:
    """``want`` with each newly Partial mesh dim made Replicate (partitioned locally afterwards).

    The executor cannot move ``Shard -> Partial`` in the forward pass; Replicate then a local
    split into terms is the same value and needs only the gather.
    """
    moved = [(j, q) for j, (p, q) in enumerate(zip(have.placements, want.placements))
             if q.is_partial() and p != q]
    if not moved:
        return want, []
    pl = [Replicate() if any(j == m for m, _ in moved) else q for j, q in enumerate(want.placements)]
    return want.with_placements(pl, want.shard_order), moved


def _partitioner(parts: list[tuple[int, int, Placement]], mesh) -> Callable[[list], list]:
    def local_args(flat: list) -> list:
        coord = mesh.get_coordinate()
        flat = list(flat)
        for e, j, q in parts:
            flat[e] = q.split_value(flat[e], mesh.shape[j], coord[j])
        return flat

    return local_args


def _compose(fns: list[tuple[list[int], Callable]]) -> Callable[[list], list]:
    def local_args(flat: list) -> list:
        flat = list(flat)
        for leaves, fn in fns:
            new = fn([flat[p] for p in leaves])
            for p, v in zip(leaves, new):
                flat[p] = v
        return flat

    return local_args


# -- fused optimizers ----------------------------------------------------------------------

FUSED_LISTS = {
    "_fused_adam": ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"),
    "_fused_adamw": ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"),
    "_fused_sgd": ("self", "grads", "momentum_buffer_list"),
}
MOVABLE_STATE = frozenset({"_fused_sgd"})
"""Fused ops whose in-place state placed unlike its params decomposes into foreach ops (a first
momentum buffer is ``empty_like(grad)``, so a ``Partial`` grad gives a ``Partial`` buffer);
the others' state cannot move and raises."""
REPLICATED_ARGS = ("state_steps", "grad_scale", "found_inf", "lr")


def fused_optimizer_rule(call: Call) -> Decision:
    """Every state list takes the params' placements; scalars-as-tensors must be Replicate."""
    name = call.op._schema.name.split("::")[-1]
    inplace = name.endswith("_")
    lists = FUSED_LISTS[name.rstrip("_")]
    params = call.positions("self")
    if any(p is None for p in params):
        raise call.refuse("with plain-tensor params mixed with DTensors")
    required = list(call.specs)
    for i, pos in enumerate(params):
        s = call.specs[pos]
        if any(p.is_partial() for p in s.placements):
            raise PropagationError(f"shardtensor: {call.op}: param {i} is Partial {s.placements}; optimizer params "
                               "must be Replicate or Shard")
    grad_scale = call.arg("grad_scale", None)
    for lname in lists[1:]:
        pos_list = call.positions(lname)
        if not pos_list:
            continue
        if len(pos_list) != len(params):
            raise PropagationError(f"shardtensor: {call.op}: {lname} has {len(pos_list)} tensors, params {len(params)}")
        for i, (pp, pos) in enumerate(zip(params, pos_list)):
            if pos is None:
                raise call.refuse(f"with a plain tensor in {lname}[{i}]")
            ps, s = call.specs[pp], call.specs[pos]
            want = s.with_placements(ps.placements, ps.shard_order)
            if want == s:
                continue
            if inplace and lname != "grads" and name.rstrip("_") in MOVABLE_STATE:
                raise call.refuse(f"with {lname}[{i}] placed {s.placements} unlike its param "
                                  f"{ps.placements} in the fused kernel")
            if inplace and lname != "grads":
                raise PropagationError(f"shardtensor: {call.op}: {lname}[{i}] has placements {s.placements} but its param "
                                   f"{ps.placements}; the optimizer state is updated in place and cannot move")
            if inplace and grad_scale is not None:
                raise call.refuse(f"with grad_scale and grads[{i}] placed {s.placements} unlike "
                                  f"its param {ps.placements} (the kernel unscales grads in place)")
            required[pos] = want
    for aname in REPLICATED_ARGS:
        try:
            where = call.positions(aname) if aname == "state_steps" else [call.pos(aname)]
        except KeyError:
            continue
        for pos in where:
            if pos is not None:
                s = call.specs[pos]
                required[pos] = s.with_placements([Replicate()] * s.mesh.ndim)
    moves = {pos: r for pos, r in enumerate(required) if r is not None}
    kernel = functools.partial(contiguous_fused, call.op)
    if inplace:
        return finish(call, moves, None, kernel=kernel)
    meta = call.out_meta
    outs = []
    for lname, metas in zip(lists, meta):
        pos_list = call.positions(lname) or []
        outs.append([DTensorSpec.build(call.mesh, call.specs[pp].placements, m.shape, m.stride(), m.dtype,
                                       call.specs[pp].shard_order) for pp, m in zip(params, metas)]
                    if pos_list else [])
    return finish(call, moves, tuple(outs), kernel=kernel)


_IS_CONTIGUOUS = torch.Tensor.is_contiguous


def contiguous_fused(op, *args: Any, **kwargs: Any) -> Any:
    """Run a fused optimizer kernel on contiguous tensors (the CPU kernels index raw memory).

    A redistributed grad may be a strided view; tensors the kernel updates in place are
    copied back when they had to be made contiguous.
    """
    back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def fix(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            try:
                if all(map(_IS_CONTIGUOUS, v)):
                    return v  # the common case: nothing to copy
            except TypeError:  # not all tensors: looked at one by one
                pass
            return type(v)(fix(t) for t in v)
        if isinstance(v, torch.Tensor) and not v.is_contiguous():
            c = v.contiguous()
            back.append((v, c))
            return c
        return v

    out = op(*[fix(a) for a in args], **{k: fix(v) for k, v in kwargs.items()})
    for orig, c in back:
        orig.copy_(c)
    return out


# -- registration --------------------------------------------------------------------------

def overloads(name: str) -> list[Any]:
    packet = getattr(aten, name, None)
    if packet is None:
        return []
    out = []
    for o in packet.overloads():
        op = getattr(packet, o)
        if "out" in o.lower() and any(a.name == "out" for a in op._schema.arguments):
            continue
        out.append(op)
    return out


FOREACH_OPS: list[Any] = []
for _n in [*UNARY, *ARITH, *CLAMPS, "addcmul", "addcdiv", "pow", "lerp"]:
    for _op in overloads(f"_foreach_{_n}") + overloads(f"_foreach_{_n}_"):
        if _element_op(_op) is not None:
            FOREACH_OPS.append(_op)
FOREACH_OPS += [aten._foreach_copy_.default, aten._foreach_zero_.default]
FUSED_OPS: list[Any] = [op for n in ("_fused_adam", "_fused_adam_", "_fused_adamw", "_fused_adamw_", "_fused_sgd",
                                      "_fused_sgd_")
                        for op in overloads(n)]


register(*FOREACH_OPS, scalars_by_sign=True)(foreach_rule)
register(*FUSED_OPS, scalars_by_sign=True)(fused_optimizer_rule)
