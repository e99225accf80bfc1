"""Reductions over dims: one shared machinery.

``D`` (the reduced dims) comes from the dim argument: absent / ``None`` / ``[]`` -> all dims,
an int or a list -> those dims; a 0-d input reduces nothing.  ``D`` is checked against the
shape-inferred output.  Per mesh dim the required input placement and the output are:

========================================  =====================  =====================  ============
op                                        Partial kinds kept     ``S(d in D)`` ->       kernel
========================================  =====================  =====================  ============
sum.default/.dim_IntList, nansum          sum, avg               P(sum)                 aten
mean.default/.dim                         sum, avg               P(avg) if even, else   uneven: local
                                                                 P(sum)                 sum / N_global
prod.default/.dim_int                     product                P(product)             aten
amax, max.default                         max                    P(max)                 empty -> -inf
amin, min.default                         min                    P(min)                 empty -> +inf
any.default/.dim/.dims                    max (bool input)       P(max) (OR)            aten
all.default/.dim/.dims                    min (bool input)       P(min) (AND)           aten
argmax, argmin                            none                   gathered               aten
var.correction, std.correction            none                   kept sharded: var      two-pass with
                                                                 P(sum) (R if N-c<=0),  all-reduced
                                                                 std R                  sum (and M2)
cumsum                                    sum, avg               gathered               aten
cumprod, logcumsumexp, cummax, cummin     none                   gathered               aten
========================================  =====================  =====================  ============

``S(d not in D)`` is kept and renumbered (keepdim false), ``R`` stays ``R``.  A Partial input
of a kind that may not stay, or a Shard that must be gathered, has a real choice: ``R``
(all-reduce / all-gather) or ``S(e)`` of another dim (reduce-scatter / all-to-all); every
combination is offered and the engine keeps the cheapest.  Otherwise the one candidate
follows the input.  Empty local shards of max/min reductions give the identity instead of
letting torch raise.  ``max.dim``/``min.dim``, ``var_mean``/``std_mean`` and ``out=`` overloads
reach these rules through decompositions.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterable, Sequence

import torch

from ...errors import PropagationError
from ...placement import Partial, Placement, Replicate, Shard
from ...spec import DTensorSpec, contiguous_stride
from .. import kernels
from ..call import Call, Decision
from ..registry import register
from ..strategy import Pl, finish, input_cost, keep_order, kept_order, pick

aten = torch.ops.aten

__all__ = ["reduced_dims", "reduce_out", "out_order", "choices", "identity_of",
           "reduced_local_shape", "MAX_CANDIDATES"]

MAX_CANDIDATES = 64


# -- shared machinery ------------------------------------------------------------------------

def reduced_dims(dim: Any, ndim: int) -> tuple[int, ...]:
    """Normalized reduced dims: ``None``/``[]`` -> all dims; a 0-d input reduces no dim."""
    if ndim == 0:
        return ()
    if dim is None:
        return tuple(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return tuple(range(ndim))
    out = set()
    for d in dims:
        if not -ndim <= d < ndim:
            raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {d})")
        out.add(d % ndim)
    return tuple(sorted(out))


def check_dims(call: Call, spec: DTensorSpec, D: Sequence[int], keepdim: bool, meta: Any = None) -> None:
    """Raise when ``D``/keepdim disagree with the shape-inferred output (never guess)."""
    meta = call.out_meta if meta is None else meta
    if isinstance(meta, (tuple, list)):
        meta = meta[0]
    want = spec.ndim if keepdim else spec.ndim - len(D)
    if meta.ndim != want:
        raise call.refuse(f"reduces dims {list(D)} (keepdim={keepdim}) but the output has "
                          f"{meta.ndim} dims, not {want}")


def require_nonempty(op: Any, spec: DTensorSpec, D: Sequence[int], all_dims: bool) -> None:
    """Raise as torch does for a reduction without identity (max, argmin, ...) over nothing.

    Decided on the global shape, so every rank raises alike (a rank's empty shard is no error).
    """
    name = op._schema.name.split("::")[-1]
    if all_dims and math.prod(spec.shape) == 0:
        raise PropagationError(f"shardtensor: {name}(): Expected reduction dim to be specified for input.numel() == 0 "
                           f"(global shape {tuple(spec.shape)}). Specify the reduction dim with the 'dim' argument.")
    for d in D:
        if spec.shape[d] == 0:
            raise PropagationError(f"shardtensor: {name}(): Expected reduction dim {d} to have non-zero size "
                               f"(global shape {tuple(spec.shape)}).")


def _new_dim(d: int, D: Sequence[int], keepdim: bool) -> int:
    return d if keepdim else d - sum(1 for e in D if e < d)


def reduce_out(pl: Sequence[Placement], D: Sequence[int], keepdim: bool, kind: Placement | None) -> Pl:
    """The output placements of a reduction over ``D``: ``S(d in D)`` -> ``kind``, other shards renumbered."""
    out: list[Placement] = []
    for p in pl:
        if p.is_shard():
            if p.dim in D:
                if kind is None:
                    raise AssertionError(f"reduced dim {p.dim} still sharded in a non-decomposable reduction")
                out.append(kind)
            else:
                out.append(Shard(_new_dim(p.dim, D, keepdim)))
        else:
            out.append(p)
    return tuple(out)


def out_order(order, out_pl: Sequence[Placement], D: Sequence[int], keepdim: bool):
    """The input order carried to the output: dims renumbered, reduced dims dropped."""
    res = []
    for d, js in order:
        if d in D:
            continue
        nd = _new_dim(d, D, keepdim)
        here = Shard(nd)
        keep = tuple(j for j in js if out_pl[j] == here)
        if keep:
            res.append((nd, keep))
    return tuple(res)


def _targets(spec: DTensorSpec, j: int, dims: Iterable[int]) -> list[Placement]:
    k = spec.mesh.shape[j]
    return [Shard(e) for e in dims if spec.shape[e] >= k]


def choices(spec: DTensorSpec, D: Sequence[int], *, decomposable: bool,
            keep: Callable[[Partial], bool], shard_dims: Sequence[int] | None = None) -> list[Pl]:
    """Required placements to consider for one input, the follow-the-input one first.

    Per mesh dim: an acceptable entry is kept; a Partial that may not stay, or (for a
    non-decomposable op) a Shard of a reduced dim, becomes ``R`` or ``S(e)`` for each ``e`` in
    ``shard_dims`` (default: the unreduced dims, or every dim when decomposable).
    """
    if shard_dims is None:
        shard_dims = range(spec.ndim) if decomposable else [e for e in range(spec.ndim) if e not in D]
    per: list[list[Placement]] = []
    for j, p in enumerate(spec.placements):
        if spec.mesh.shape[j] == 1:
            per.append([p if not p.is_partial() or keep(p) else Replicate()])
        elif p.is_partial() and not keep(p):
            per.append([Replicate()] + _targets(spec, j, shard_dims))
        elif p.is_shard() and p.dim in D and not decomposable:
            per.append([Replicate()] + [t for t in _targets(spec, j, shard_dims) if t != p])
        else:
            per.append([p])
    return list(itertools.islice(itertools.product(*per), MAX_CANDIDATES))


def out_spec(call: Call, meta: torch.Tensor, pl: Sequence[Placement], order) -> DTensorSpec:
    return DTensorSpec.build(call.mesh, pl, meta.shape, meta.stride(), meta.dtype, order)


def identity_of(kind: str, dtype: torch.dtype) -> Any:
    """The identity of a max/min combine for ``dtype`` (-inf/dtype min for max, +inf/dtype max for min)."""
    if dtype == torch.bool:
        return kind == "min"
    if dtype.is_floating_point:
        return -math.inf if kind == "max" else math.inf
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


def reduced_local_shape(shape: Sequence[int], D: Sequence[int], keepdim: bool) -> list[int]:
    return [1 if d in D else n for d, n in enumerate(shape) if keepdim or d not in D]


def empty_safe(op: Any, D: Sequence[int], keepdim: bool, fill: Callable[[torch.dtype], Any],
               dtype: torch.dtype) -> Callable:
    """Kernel: ``op`` on the local shard, or ``fill(dtype)`` where a reduced dim is locally empty."""

    def kernel(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if x.ndim and any(x.shape[d] == 0 for d in D):
            return torch.full(reduced_local_shape(x.shape, D, keepdim), fill(dtype), dtype=dtype, device=x.device)
        return op(x, *args, **kwargs)

    return kernel


# -- decomposable reductions -----------------------------------------------------------------

SUM_KEEP = ("sum", "avg")
_KIND: dict[Any, tuple[str, tuple[str, ...]]] = {}
"""op -> (partial kind produced by ``S(d in D)``, kinds kept)."""
for _op in (aten.sum.default, aten.sum.dim_IntList, aten.nansum.default):
    _KIND[_op] = ("sum", SUM_KEEP)
for _op in (aten.mean.default, aten.mean.dim):
    _KIND[_op] = ("avg", SUM_KEEP)
for _op in (aten.prod.default, aten.prod.dim_int):
    _KIND[_op] = ("product", ("product",))
for _op in (aten.amax.default, aten.max.default):
    _KIND[_op] = ("max", ("max",))
for _op in (aten.amin.default, aten.min.default):
    _KIND[_op] = ("min", ("min",))
for _op in (aten.any.default, aten.any.dim, aten.any.dims):
    _KIND[_op] = ("max", ("max",))
for _op in (aten.all.default, aten.all.dim, aten.all.dims):
    _KIND[_op] = ("min", ("min",))
_FULL = {aten.sum.default, aten.mean.default, aten.prod.default, aten.max.default, aten.min.default,
         aten.any.default, aten.all.default}
_EMPTY_RAISES = {aten.amax.default, aten.amin.default, aten.max.default, aten.min.default}
_BOOL_ONLY_KEEP = {aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims}


def dim_args(call: Call) -> tuple[Any, bool]:
    """``(dim, keepdim)`` of a reduction call (full-reduction overloads: ``(None, False)``)."""
    if call.op in _FULL:
        return None, False
    return call.arg("dim", None), bool(call.arg("keepdim", False))


def _evenly_split(spec: DTensorSpec, pl: Sequence[Placement], D: Sequence[int]) -> bool:
    """Every rank holds the same number of reduced elements (nested sharding included)."""
    for d in D:
        k = 1
        for j, p in enumerate(pl):
            if p == Shard(d):
                k *= spec.mesh.shape[j]
        if spec.shape[d] % k:
            return False
    return True


@register(*_KIND)
def decomposable_rule(call: Call) -> Decision:
    """sum / mean / prod / amax / amin / max / min / any / all."""
    pos = call.pos("self")
    s = call.specs[pos]
    dim, keepdim = dim_args(call)
    D = reduced_dims(dim, s.ndim)
    meta = call.shaped_meta(reduced_local_shape(s.shape, D, keepdim))
    check_dims(call, s, D, keepdim, meta)
    kind, kept = _KIND[call.op]
    if call.op in _EMPTY_RAISES:
        require_nonempty(call.op, s, D, dim in (None, [], ()))
    bool_only = call.op in _BOOL_ONLY_KEEP

    def keep(p: Partial) -> bool:
        if p.plain_op() not in kept:
            return False
        return s.dtype == torch.bool if bool_only else True

    req = pick(call, pos, choices(s, D, decomposable=True, keep=keep))
    kernel = None
    if kind == "avg" and not _evenly_split(s, req, D):
        kind = "sum"
        kernel = _uneven_mean(s, D, keepdim, meta.dtype)
    elif call.op in _EMPTY_RAISES and any(p.is_shard() and p.dim in D for p in req):
        kernel = empty_safe(call.op, D, keepdim, lambda dt, k=kind: identity_of(k, dt), meta.dtype)
    out_pl = reduce_out(req, D, keepdim, Partial(kind))
    order = out_order(kept_order(s, req), out_pl, D, keepdim)
    return finish(call, {pos: req}, out_spec(call, meta, out_pl, order), kernel=kernel, order=keep_order)


def _uneven_mean(spec: DTensorSpec, D: Sequence[int], keepdim: bool, out_dtype: torch.dtype) -> Callable:
    """Kernel: local sum / global count -> a Partial(sum) term exact for any split."""
    n_global = 1
    for d in D:
        n_global *= spec.shape[d]
    acc = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype

    def kernel(x: torch.Tensor, *args: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
        x = x.to(acc)
        s = x.sum(dim=list(D), keepdim=keepdim) if D else x.clone()
        return (s / n_global).to(out_dtype)

    return kernel


# -- argmax / argmin -------------------------------------------------------------------------

_SELECTING = (aten.argmax.default, aten.argmin.default, aten.kthvalue.default, aten.mode.default,
              aten.median.dim, aten.nanmedian.dim, aten.median.default, aten.nanmedian.default)


@register(*_SELECTING)
def selecting_rule(call: Call) -> Decision:
    """argmax/argmin, kthvalue, mode, median: the reduced dim (everything for ``dim=None``) is
    gathered, partials reduced; other shards kept and renumbered.  Values and indices alike."""
    pos = call.pos("self")
    s = call.specs[pos]
    has_dim = any(a.name == "dim" for a in call.op._schema.arguments)
    dim = call.arg("dim", _schema_default(call.op, "dim")) if has_dim else None
    keepdim = bool(call.arg("keepdim", False)) if has_dim else False
    meta = call.out_meta
    if call.op not in (aten.median.default, aten.nanmedian.default):  # those give nan on no elements
        require_nonempty(call.op, s, reduced_dims(dim, s.ndim), dim is None)
    metas = list(meta) if isinstance(meta, (tuple, list)) else [meta]
    if dim is None:
        req: Pl = (Replicate(),) * s.mesh.ndim
        outs = [out_spec(call, m, req, ()) for m in metas]
    else:
        D = reduced_dims(dim, s.ndim)
        check_dims(call, s, D, keepdim, metas[0])
        req = pick(call, pos, choices(s, D, decomposable=False, keep=lambda p: False))
        out_pl = reduce_out(req, D, keepdim, None)
        order = out_order(kept_order(s, req), out_pl, D, keepdim)
        outs = [out_spec(call, m, out_pl, order) for m in metas]
    return finish(call, {pos: req}, type(meta)(outs) if isinstance(meta, (tuple, list)) else outs[0], order=keep_order)


def _schema_default(op: Any, name: str) -> Any:
    for a in op._schema.arguments:
        if a.name == name:
            return a.default_value if a.has_default_value() else None
    return None


# -- var / std -------------------------------------------------------------------------------

@register(aten.var.correction, aten.std.correction)
def var_std_rule(call: Call) -> Decision:
    """Reduced dims stay sharded: the kernel all-reduces the sums (two-pass) over the mesh dims
    that shard ``D``.  var ends Partial(sum) there (Replicate when ``N - correction <= 0``,
    where rank terms of inf/NaN would not add up to dense torch's), std ends Replicate.
    Partial inputs are reduced (or reduce-scattered) first: variance is not linear."""
    pos = call.pos("self")
    s = call.specs[pos]
    D = reduced_dims(call.arg("dim", None), s.ndim)
    keepdim = bool(call.arg("keepdim", False))
    correction = call.arg("correction", None)
    correction = 1 if correction is None else correction
    meta = _var_meta(s, D, keepdim)
    n_global = 1
    for d in D:
        n_global *= s.shape[d]
    denom = max(0, n_global - correction)
    is_std = call.op is aten.std.correction
    partial_out = not is_std and denom > 0
    req = min(choices(s, D, decomposable=True, keep=lambda p: False),
              key=lambda c: input_cost(s, c) + _merge_cost(s, c, D, 1 if partial_out else 2))
    J = [j for j, p in enumerate(req) if p.is_shard() and p.dim in D and s.mesh.shape[j] > 1]
    kind = Partial("sum") if partial_out else Replicate()
    out_pl = reduce_out(req, D, keepdim, kind)
    order = out_order(kept_order(s, req), out_pl, D, keepdim)
    kernel = None
    if J:
        kernel = kernels.variance(s.mesh, J, D, keepdim, n_global, denom, is_std, partial_out, meta.dtype)
    return finish(call, {pos: req}, out_spec(call, meta, out_pl, order), kernel=kernel, order=keep_order)


def _merge_cost(s: DTensorSpec, req: Pl, D: Sequence[int], n: int) -> float:
    """Modeled time of the variance kernel's ``n`` all-reduces of per-row sums over the mesh
    dims where ``req`` shards a reduced dim (0 where none does)."""
    J = [j for j, p in enumerate(req) if p.is_shard() and p.dim in D and s.mesh.shape[j] > 1]
    if not J:
        return 0.0
    shape = tuple(1 if d in D else k for d, k in enumerate(s.shape))
    rest = [p if p.is_shard() and p.dim not in D else Replicate() for p in req]
    sums = DTensorSpec.build(s.mesh, [Partial("sum") if j in J else p for j, p in enumerate(rest)], shape,
                             contiguous_stride(shape), s.dtype)
    return n * input_cost(sums, tuple(rest))


def _var_meta(spec: DTensorSpec, D: Sequence[int], keepdim: bool) -> torch.Tensor:
    """Output metadata of var/std without torch's (slow, Python) meta path."""
    dtype = spec.dtype.to_real() if spec.dtype.is_complex else spec.dtype
    if not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError(f"std and var only support floating point and complex dtypes, got {spec.dtype}")
    return torch.empty(reduced_local_shape(spec.shape, D, keepdim), dtype=dtype, device="meta")


# -- cumulative ops --------------------------------------------------------------------------

_SCANS = {aten.cumsum.default: SUM_KEEP, aten.cumprod.default: (), aten.logcumsumexp.default: (),
          aten.cummax.default: (), aten.cummin.default: ()}


@register(*_SCANS)
def scan_rule(call: Call) -> Decision:
    """Gather the scan dim (to ``R`` or another dim's shard); other shards kept.  cumsum is
    linear, so Partial(sum|avg) stays; the other scans reduce partials first."""
    pos = call.pos("self")
    s = call.specs[pos]
    kept = _SCANS[call.op]
    if s.ndim == 0:
        D: tuple[int, ...] = ()
    else:
        D = (call.arg("dim") % s.ndim,)
    req = pick(call, pos, choices(s, D, decomposable=False, keep=lambda p: p.plain_op() in kept))
    order = kept_order(s, req)
    meta = call.out_meta
    if isinstance(meta, (tuple, list)):
        out = type(meta)(out_spec(call, m, req, order) for m in meta)
    else:
        out = out_spec(call, meta, req, order)
    return finish(call, {pos: req}, out, order=keep_order)
