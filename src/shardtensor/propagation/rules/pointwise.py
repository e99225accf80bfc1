"""Elementwise ops: same placements in and out, with broadcasting; Partial only where linear.

Per mesh dim: if any input is sharded on a non-broadcast dim, the output is sharded there and
every input follows (Replicate where it broadcasts).  Otherwise Partial inputs stay Partial
only for ops that commute with the partial's reduction, written as data in ``PARTIAL_ROWS``:

- ``any``: identity-like ops (clone, detach, alias) keep any Partial kind;
- ``cast``: a dtype cast keeps it where it commutes with the reduction (:func:`cast_keeps`);
- ``terms``: add/sub/rsub (and ``complex(re, im)``, linear in both jointly) of Partial(sum|avg)
  terms and Replicate tensors (the Replicate operands are partitioned locally, no communication);
- ``factor``: mul/neg with exactly one Partial(sum|avg) factor, every other operand
  Replicate or a scalar; ``numerator``: the same for a division, the factor on top.

Partial(max) and Partial(min) pass through monotone ops, written in ``ORDER_ROWS``: a
non-decreasing op ``f`` with one Partial operand (the others Replicate or scalars) keeps the
kind, since ``f(max_r a_r) = max_r f(a_r)`` (rounding is monotone too, so it holds bit for bit);
a non-increasing one swaps max and min; ``maximum`` of Partial(max) operands is Partial(max),
``minimum`` of Partial(min) ones Partial(min).  Ops defined on part of the line only (log,
sqrt) are not listed: a NaN from one rank's out-of-domain term would survive the max.

Anything else reduces its Partial inputs to Replicate first.
"""
from __future__ import annotations

from typing import Any

import torch

from ...errors import PropagationError
from ...placement import Partial, Placement, Replicate, Shard, unpartial
from ...spec import DTensorSpec
from ..call import Call, Decision
from ..registry import TAG_RULES, register
from ..strategy import LINEAR_KINDS, Option, decide, expand, finish, input_cost, linear_partial

aten = torch.ops.aten

IDENTITY = {aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default, aten.positive.default}
PARTIAL_ROWS: dict[Any, str] = {
    **dict.fromkeys([aten.clone.default, aten.detach.default, aten.alias.default, aten.positive.default], "any"),
    aten._to_copy.default: "cast",
    **dict.fromkeys([aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor, aten.rsub.Tensor,
                     aten.complex.default], "terms"),
    **dict.fromkeys([aten.mul.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.mul_.Tensor,
                     aten.mul_.Scalar, aten.div_.Scalar, aten.neg_.default], "factor"),
    **dict.fromkeys([aten.div.Tensor, aten.div_.Tensor], "numerator"),
}
"""How each op treats a Partial operand (see the module docstring); ops not listed reduce it."""
ORDER_ROWS: dict[Any, str] = {
    **dict.fromkeys([aten.relu.default, aten.exp.default, aten.exp2.default, aten.expm1.default, aten.sigmoid.default,
                     aten.tanh.default, aten.atan.default, aten.asinh.default, aten.sinh.default, aten.erf.default,
                     aten.floor.default, aten.ceil.default, aten.trunc.default, aten.round.default, aten.sign.default,
                     aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.hardtanh.default,
                     aten.logaddexp.default, aten.logaddexp2.default, aten.clamp_min.Tensor, aten.clamp_max.Tensor,
                     aten.relu_.default, aten.exp_.default, aten.sigmoid_.default, aten.tanh_.default,
                     aten.clamp_.default, aten.clamp_min_.default, aten.clamp_max_.default], "up"),
    **dict.fromkeys([aten.maximum.default, aten.fmax.default], "up, max joins"),
    **dict.fromkeys([aten.minimum.default, aten.fmin.default], "up, min joins"),
    **dict.fromkeys([aten.neg.default, aten.erfc.default], "down"),
    **dict.fromkeys([aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor], "up in self"),
}
"""How each op treats a Partial(max|min) operand (see the module docstring): ``up`` keeps it
(non-decreasing in every operand), ``up in self`` only as the first operand (``a - c``, ``a + c``;
``c - a`` decreases), ``down`` swaps max and min, ``... joins``: every operand that kind keeps it."""
_SWAP = {"max": "min", "min": "max"}
EVERY_OPERAND = ("any", "cast", "terms")
"""Rows under which every tensor operand takes the Partial (others: only the Partial factor)."""
EXTRA_POINTWISE = {
    aten.floor_divide.default, aten.floor_divide.Scalar, aten.floor_divide_.Tensor, aten.floor_divide_.Scalar,
    aten.rsub.Tensor, aten.rsub.Scalar, aten.hardswish.default, aten.hardswish_.default,
    aten.hardswish_backward.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
    aten.masked_fill_.Scalar, aten.masked_fill_.Tensor, aten.complex.default, aten.polar.default,
    aten._prelu_kernel.default,
}
IDENTITY_INPLACE = {aten.zero_.default}
FILL_INPLACE = {aten.fill_.Scalar, aten.fill_.Tensor}
LIKE_KEEP = {aten.zeros_like.default, aten.empty_like.default}
LIKE_FILL = {aten.ones_like.default, aten.full_like.default}


def _is_inplace(op) -> bool:
    return op._schema.name.endswith("_") or any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments[:1])


def _order_kind(call: Call, kinds: set[str], partial_args: list[int]) -> str | None:
    """The output's Partial kind on a mesh dim where ``partial_args`` are Partial(max|min) and
    the other tensor operands Replicate (``ORDER_ROWS``); None: reduce them first."""
    row = ORDER_ROWS.get(call.op)
    if row is None or len(kinds) != 1 or not kinds <= {"max", "min"}:
        return None
    kind = next(iter(kinds))
    if len(partial_args) > 1:
        every = len(partial_args) == len(call.tensor_positions)
        return kind if every and row == f"up, {kind} joins" else None
    if row == "down":
        return _SWAP[kind] if len(call.tensor_positions) == 1 else None
    if row == "up in self" and partial_args[0] != 0:
        return None
    return kind


def _keeps_partial(call: Call, kinds: set[str], partial_args: list[int]) -> bool:
    """Whether the output may stay Partial (of the same kind) on a mesh dim where
    ``partial_args`` are Partial(``kinds``), under ``PARTIAL_ROWS``."""
    row = PARTIAL_ROWS.get(call.op)
    if row is None or len(kinds) != 1:
        return False
    kind = next(iter(kinds))
    if row == "any":
        return True
    if row == "cast":
        return cast_keeps(kind, call.specs[partial_args[0]].dtype, call.out_meta.dtype)
    if kind not in LINEAR_KINDS:
        return False
    if row == "terms":
        return all(call.specs[i] is not None for i in range(min(2, len(call.flat))))
    return len(partial_args) == 1 and (row == "factor" or partial_args[0] == 0)


def _plain(ps: Any) -> bool:
    """Plain ``Partial`` s only: a norm partial's ``reduce_op`` (sum for ``PN(2)``) is not its value."""
    return all(p.plain_op() is not None for p in ps)


def _kept(call: Call, ps: list[Placement], group: list[int]) -> Placement | None:
    """The Partial the output keeps where operands ``group`` hold ``ps`` (``PARTIAL_ROWS``), or
    None.  A norm partial passes only the rows that move values unchanged (``any``) or widen them
    (``cast``), as itself: ``clone`` of a ``PN(2)`` norm is that ``PN(2)``, with no collective."""
    kinds = {p.reduce_op for p in ps}  # type: ignore[attr-defined]
    if not _keeps_partial(call, kinds, group):
        return None
    if _plain(ps):
        return Partial(next(iter(kinds)))
    same = all(p == ps[0] for p in ps)
    return ps[0] if same and PARTIAL_ROWS.get(call.op) in ("any", "cast") else None


def cast_keeps(kind: str, src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a cast ``src -> dst`` commutes with the reduction of a ``Partial(kind)``.

    A widening float cast commutes with every kind: float16 -> float32, float32 -> complex64.
    A rounding cast commutes with max/min between floats only (rounding is monotone); for sum,
    avg and product round(a + b) != round(a) + round(b), so such a cast reduces the Partial
    first.  Integer casts keep only max/min, and only widening (a sum of int8 terms wraps where
    their int64 sum does not); bool and integer -> float casts never keep a Partial.
    """
    if src == dst:
        return True
    if src == torch.bool or dst == torch.bool:
        return False
    widening = torch.promote_types(src, dst) == dst
    if src.is_floating_point or src.is_complex:
        return widening or (kind in ("max", "min") and dst.is_floating_point and src.is_floating_point)
    return widening and not (dst.is_floating_point or dst.is_complex) and kind in ("max", "min")


def _inplace_rule(call: Call) -> Decision:
    """In-place ops keep self's placements; every other operand is brought to them.

    Where self is Partial, the op must commute with the partial's reduction: additive ops take
    the other operand as the same Partial (a Replicate operand is split locally), multiplicative
    ones need the others Replicate (self is the one Partial factor).  Otherwise self itself is
    reduced to Replicate on that mesh dim first (its value is kept; its placements change), so
    in-place updates inside composite ops (``mean(...).add_(eps)``) stay right.
    """
    me = call.specs[0]
    nd = me.ndim
    inputs = list(call.specs)
    others = [i for i, s in enumerate(call.specs) if s is not None and i != 0]
    self_pl = list(me.placements)
    for j, p in enumerate(me.placements):
        if not p.is_partial():
            continue
        row = PARTIAL_ROWS.get(call.op)
        keeps = (linear_partial(p) and (row in ("factor", "numerator") or (row == "terms" and others == [1]))) or \
            _order_kind(call, {p.reduce_op}, [0]) == p.reduce_op
        if not keeps or (row == "terms" and any(call.specs[i].placements[j].is_shard() for i in others)):
            self_pl[j] = Replicate()  # (a shard cannot become a term of the Partial)
    if tuple(self_pl) != me.placements:
        inputs[0] = me.with_placements(self_pl)
    target = inputs[0]
    for i in others:
        s = call.specs[i]
        need: list[Placement] = []
        for p in target.placements:
            if p.is_shard():
                d = p.dim - (nd - s.ndim)
                need.append(Shard(d) if d >= 0 and s.shape[d] == me.shape[p.dim] else Replicate())
            elif p.is_partial():
                need.append(p if PARTIAL_ROWS.get(call.op) == "terms" and linear_partial(p) else Replicate())
            else:
                need.append(Replicate())
        order = []
        for d, js in target.shard_order:
            keep = tuple(j for j in js if need[j] == Shard(d - (nd - s.ndim)))
            if keep:
                order.append((d - (nd - s.ndim), keep))
        want = s.with_placements(need, tuple(sorted(order)))
        if want != s:
            inputs[i] = want
    return finish(call, {i: x for i, x in enumerate(inputs) if x is not None}, target)


def pointwise_rule(call: Call) -> Decision:
    """Per-mesh-dim rule for every op tagged pointwise (and the identity/like ops).

    The inputs' own layout (:func:`_follow`) decides where it needs no communication; where it
    does, every correct per-mesh-dim choice (:func:`_options`) is priced and the cheapest wins.
    """
    if call.specs and call.specs[0] is not None and _is_inplace(call.op) and call.op not in IDENTITY_INPLACE:
        me = call.specs[0]
        out0 = call.out_meta
        if isinstance(out0, torch.Tensor) and tuple(out0.shape) == tuple(me.shape):
            return _inplace_rule(call)
    base = _follow(call)
    if _is_inplace(call.op) or not _communicates(call, base):
        return base
    out = call.out_meta
    out0 = out[0] if isinstance(out, (tuple, list)) else out
    pos = call.tensor_positions
    if any(call.specs[i].ndim > out0.ndim for i in pos):
        return base
    options = [_options(call, j, out0) for j in range(call.mesh.ndim)]
    if all(len(o) == 1 for o in options):
        return base
    return decide(call, expand(options, pos))


def _in_dim(spec: DTensorSpec, out0: torch.Tensor, od: int) -> int | None:
    """The operand's dim that maps to output dim ``od``, or None where it broadcasts there."""
    d = od - (out0.ndim - spec.ndim)
    return d if d >= 0 and spec.shape[d] == out0.shape[od] else None


def _communicates(call: Call, d: Decision) -> bool:
    """Whether decision ``d`` moves an input across ranks (not only a local slice)."""
    return any(want is not None and have is not None and input_cost(have, want.placements) > 0
               for have, want in zip(call.specs, d.inputs))


def _options(call: Call, j: int, out0: torch.Tensor) -> list[Option]:
    """Every correct choice on mesh dim ``j``: shard an output dim an input shards (each
    operand follows or is Replicate where it broadcasts), keep a Partial where a row allows
    it (each single Partial operand alone too: ``P * P`` reduces one factor), reduce-scatter a
    Partial into a shard where another mesh dim already shards an operand (where none does, the
    result stays Replicate, as torch's DTensor leaves it: see docs/propagation.md), or Replicate
    everything.  The inputs' own choice comes first, so ties keep it; a mesh dim of one rank keeps
    only that."""
    pos = call.tensor_positions
    nd = out0.ndim
    pls = {i: call.specs[i].placements[j] for i in pos}

    def in_dim(i: int, od: int) -> int | None:
        return _in_dim(call.specs[i], out0, od)

    def sharded(od: int) -> Option:
        return {i: Shard(d) if (d := in_dim(i, od)) is not None else Replicate() for i in pos}, Shard(od)

    dims: list[int] = []
    for i in pos:
        p = pls[i]
        if p.is_shard():
            od = p.dim + nd - call.specs[i].ndim
            if in_dim(i, od) == p.dim and od not in dims:
                dims.append(od)
    opts: list[Option] = [sharded(od) for od in dims]
    partial = [i for i in pos if pls[i].is_partial()]
    for group in [partial] + ([[i] for i in partial] if len(partial) > 1 else []):
        kinds = {pls[i].reduce_op for i in group}
        if (kind := _kept(call, [pls[i] for i in group], group)) is not None:
            every = PARTIAL_ROWS[call.op] in EVERY_OPERAND
            opts.append(({i: kind if every or i in group else Replicate() for i in pos}, kind))
        elif _plain(pls[i] for i in group) and (ordered := _order_kind(call, kinds, group)) is not None:
            opts.append(({i: pls[i] if i in group else Replicate() for i in pos}, Partial(ordered)))
    if partial and any(p.is_shard() for i in pos for jj, p in enumerate(call.specs[i].placements) if jj != j):
        k = call.mesh.shape[j]
        opts += [sharded(od) for od in range(nd) if od not in dims and out0.shape[od] >= k
                 and all(in_dim(i, od) is not None for i in partial)]
    opts.append(({i: Replicate() for i in pos}, Replicate()))
    return opts if call.mesh.shape[j] > 1 else opts[:1]


def _follow(call: Call) -> Decision:
    """The decision that follows the inputs: a mesh dim an input shards stays sharded there,
    a Partial stays where its row allows, anything else is reduced to Replicate."""
    out = call.out_meta
    out_list = isinstance(out, (tuple, list))
    out0 = out[0] if out_list else out
    if not isinstance(out0, torch.Tensor):
        raise call.refuse("returns no tensor")
    nd = out0.ndim
    pos = call.tensor_positions
    specs = {i: call.specs[i] for i in pos}
    mesh = call.mesh
    in_pl: dict[int, list[Placement]] = {i: list(specs[i].placements) for i in pos}
    out_pl: list[Placement] = []

    def in_dim(i: int, od: int) -> int | None:
        return _in_dim(specs[i], out0, od)

    for j in range(mesh.ndim):
        od = None
        for i in pos:
            p = specs[i].placements[j]
            if p.is_shard() and len(specs[i].shape) <= nd:
                cand = p.dim + nd - len(specs[i].shape)
                if in_dim(i, cand) == p.dim:
                    od = cand
                    break
        if od is not None:
            out_pl.append(Shard(od))
            for i in pos:
                d = in_dim(i, od)
                in_pl[i][j] = Shard(d) if d is not None else Replicate()
            continue
        partial = [i for i in pos if specs[i].placements[j].is_partial()]
        if partial and not any(specs[i].placements[j].is_shard() for i in pos):
            kinds = {specs[i].placements[j].reduce_op for i in partial}
            kind = _kept(call, [specs[i].placements[j] for i in partial], partial)
            if kind is not None:
                out_pl.append(kind)
                for i in pos:
                    if PARTIAL_ROWS[call.op] in EVERY_OPERAND:
                        in_pl[i][j] = kind
                    else:
                        in_pl[i][j] = kind if i in partial else Replicate()
                continue
            ordered = _order_kind(call, kinds, partial) if _plain(specs[i].placements[j] for i in partial) else None
            if ordered is not None:
                out_pl.append(Partial(ordered))
                for i in pos:
                    in_pl[i][j] = specs[i].placements[j] if i in partial else Replicate()
                continue
        out_pl.append(Replicate())
        for i in pos:
            in_pl[i][j] = Replicate()

    lead = next((i for i in pos if any(p.is_shard() for p in specs[i].placements)), pos[0])
    out_order = _map_order(specs[lead], out_pl, nd - specs[lead].ndim)
    inputs = []
    for i, s in enumerate(call.specs):
        if s is None:
            inputs.append(None)
            continue
        order = _map_order_back(out_order, in_pl[i], nd - s.ndim)
        inputs.append(s.with_placements(in_pl[i], order))
    outs = list(out) if out_list else [out]
    specs_out = [DTensorSpec.build(mesh, out_pl, o.shape, o.stride(), o.dtype, out_order) for o in outs]
    if _is_inplace(call.op):
        self_spec = call.specs[0]
        if self_spec is None or inputs[0] != self_spec or tuple(out_pl) != self_spec.placements:
            have = None if self_spec is None else self_spec.placements
            raise PropagationError(
                f"shardtensor: {call.op}: in-place op on self with placements {have} would need output placements "
                f"{tuple(out_pl)}; use the out-of-place op"
            )
    output = type(out)(specs_out) if out_list else specs_out[0]
    return finish(call, {i: x for i, x in enumerate(inputs) if x is not None}, output)


def _map_order(spec: DTensorSpec, out_pl: list[Placement], shift: int):
    """The lead input's shard order carried to the output, where the output shards alike."""
    order = []
    for d, js in spec.shard_order:
        keep = tuple(j for j in js if out_pl[j] == Shard(d + shift))
        if keep:
            order.append((d + shift, keep))
    for j, p in enumerate(out_pl):
        if p.is_shard() and not any(j in js for _, js in order):
            for idx, (d, js) in enumerate(order):
                if d == p.dim:
                    order[idx] = (d, js + (j,))
                    break
            else:
                order.append((p.dim, (j,)))
    return tuple(sorted(order))


def _map_order_back(out_order, pl: list[Placement], shift: int):
    order = []
    for od, js in out_order:
        keep = tuple(j for j in js if pl[j] == Shard(od - shift))
        if keep:
            order.append((od - shift, keep))
    return tuple(order)


def inplace_fill_rule(call: Call) -> Decision:
    """``zero_`` keeps any placement; ``fill_`` of a Partial tensor makes it Replicate (no communication:
    every rank writes the constant)."""
    s = call.specs[0]
    out = s.unpartial() if call.op in FILL_INPLACE else s
    return finish(call, {}, out)


def like_rule(call: Call) -> Decision:
    """``*_like`` factories: local shapes match; fills other than zero cannot stay Partial."""
    s = call.specs[0]
    pl = s.placements if call.op in LIKE_KEEP else unpartial(s.placements)
    out = call.out_meta
    out_spec = DTensorSpec.build(s.mesh, pl, out.shape, out.stride(), out.dtype, s.shard_order)
    return finish(call, {}, out_spec)


register(*IDENTITY, *EXTRA_POINTWISE)(pointwise_rule)
register(*IDENTITY_INPLACE, *FILL_INPLACE)(inplace_fill_rule)
register(*LIKE_KEEP, *LIKE_FILL)(like_rule)
TAG_RULES.append((torch.Tag.pointwise, pointwise_rule))


@register(aten.copy_.default)
def copy_rule(call: Call) -> Decision:
    """``self.copy_(src)``: src moves to self's placements (broadcast like the copy); self keeps its spec.

    A src dim that meets a sharded self dim of the same size takes that shard; a broadcast
    (missing or length-1) dim is Replicate.  Where self is Partial and src is not that Partial,
    src is made Replicate and then partitioned locally (a forward Shard -> Partial has no collective).
    A 0-d plain src is a scalar: it is only partitioned.
    """
    dst, src = call.specs[0], call.specs[1]
    if dst is None:
        raise call.refuse("into a plain tensor")
    lead = dst.ndim - (src.ndim if src is not None else 0)
    need: list[Placement] = []
    for p, q in zip(dst.placements, src.placements if src is not None else dst.placements):
        if p.is_shard():
            d = p.dim - lead
            need.append(Shard(d) if src is not None and d >= 0 and src.shape[d] == dst.shape[p.dim] else Replicate())
        elif p.is_partial() and p == q and src is not None and tuple(src.shape) == tuple(dst.shape):
            need.append(p)
        else:
            need.append(Replicate())
    parts = [(j, p) for j, (p, n) in enumerate(zip(dst.placements, need)) if p.is_partial() and n != p]
    want = None
    if src is not None:
        order = tuple((d - lead, js) for d, js in dst.shard_order if need[js[0]] == Shard(d - lead))
        want = DTensorSpec.build(dst.mesh, need, src.shape, src.stride, src.dtype, order)
    local_args = None
    if parts:
        def local_args(flat: list) -> list:
            coord = dst.mesh.get_coordinate()
            t = flat[1]
            for j, op in parts:
                t = op.split_value(t, dst.mesh.shape[j], coord[j])
            return [flat[0], t, *flat[2:]]

    return finish(call, {} if want is None else {1: want}, dst, local_args=local_args)
