"""Differential op checks: run a function on DTensors, compare with dense single-device torch.

``check(fn, values, mesh_shape)`` is the one entry point every op-family test file uses:

- ``values``: the op's inputs -- global tensors, Python scalars, or lists of tensors (cat,
  stack, foreach ops).  Every tensor leaf gets a placement per mesh dim: Replicate, Shard(d)
  for each dim (lengths that do not divide the mesh included -- pick shapes with 7 and 3),
  and Partial of the kinds in ``partial`` (built by splitting the value into random per-rank
  terms of that kind, exact in float32).
- ``fn(*args)`` runs on DTensors and on plain tensors alike (use ``torch.*`` / ``F.*``); it may
  return a tensor or a tuple/list of tensors (``None`` entries allowed).
- each output is compared with the dense result through ``full_tensor()`` and, where it is not
  Partial, through this rank's local shard; with ``grad=True`` the backward of
  ``sum(out_i * w_i)`` is compared input by input (gradients through ``full_tensor()``).
- ``world="sim"`` (default) runs every rank as a thread in ``run_spmd``; ``world="gloo"`` runs
  4 real gloo processes (``fn`` must then be a top-level function of an importable module).

Returns ``[(input placements, output placements), ...]`` for extra assertions on placements.
"""
from __future__ import annotations

import itertools
import random
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from shardtensor import DTensor, Partial, Replicate, Shard, StridedShard, comm, init_device_mesh, run_spmd

__all__ = ["check", "prepare", "make_dtensor", "Api", "SHARDTENSOR", "close", "run_recorded", "dyadic", "data", "local_piece", "partial_terms", "placement_combos", "MESHES", "gen", "Prepared"]

MESHES = [(4,), (2, 2)]
TIMEOUT = 60.0
RES = 64.0


def run_recorded(mesh_shape, body: Callable, *args) -> tuple[list, list]:
    """Run ``body(mesh, *args)`` on every simulated rank; (per-rank results, comm events but barriers)."""
    n = 1
    for k in mesh_shape:
        n *= k

    def rank_fn():
        return body(init_device_mesh("cpu", mesh_shape), *args)

    with comm.recording() as log:
        out = run_spmd(rank_fn, n, timeout=30)
    return out, [e for e in log.events if e.kind != "barrier"]


def gen(seed: Any) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(seed) if not isinstance(seed, int) else seed)


def _seed(*parts: Any) -> int:
    return zlib.crc32(repr(parts).encode())


def dyadic(shape, g: torch.Generator, scale: float = 1.0, res: float = RES) -> torch.Tensor:
    """Random multiples of ``1/res``: sums in any order are exact in float32."""
    return torch.round(torch.randn(shape, generator=g) * scale * res) / res + 0.0


def data(kind: str, shape, g: torch.Generator) -> torch.Tensor:
    if kind == "any":
        return dyadic(shape, g)
    if kind == "nonzero":
        x = dyadic(shape, g)
        return torch.where(x >= 0, x + 0.25, x - 0.25)
    if kind == "pos":
        return dyadic(shape, g).abs() + 0.5
    if kind == "coarse":
        return torch.randint(-4, 5, shape, generator=g).float() / 2
    if kind == "bool":
        return torch.rand(shape, generator=g) > 0.5
    if kind == "int":
        return torch.randint(-5, 6, shape, generator=g)
    if kind == "distinct":  # no ties: a random permutation of multiples of 1/8
        n = 1
        for s in shape:
            n *= s
        return (torch.randperm(n, generator=g).float() / 8 - n / 16).reshape(shape)
    raise ValueError(kind)


def _chunk(n: int, k: int, r: int) -> tuple[int, int]:
    c = -(-n // k) if n else 0
    off = min(c * r, n)
    return off, min(c, n - off)


def local_piece(t: torch.Tensor, mesh_shape, coord, placements, order=None) -> torch.Tensor:
    """The piece of ``t`` a rank at ``coord`` holds (torch.chunk per sharding mesh dim, in order)."""
    if order is None:
        steps = [j for j, p in enumerate(placements) if isinstance(p, Shard)]
    else:
        steps = [j for _, js in order for j in js]
    for j in steps:
        p = placements[j]
        off, size = _chunk(t.shape[p.dim], mesh_shape[j], coord[j])
        t = t.narrow(p.dim, off, size)
    for j, p in enumerate(placements):  # a packed dim: this rank's piece of each of its groups, in order
        if isinstance(p, StridedShard):
            groups = [t.narrow(p.dim, *_chunk(t.shape[p.dim], p.split_factor, g)) for g in range(p.split_factor)]
            t = torch.cat([grp.narrow(p.dim, *_chunk(grp.shape[p.dim], mesh_shape[j], coord[j])) for grp in groups],
                          dim=p.dim)
    return t.clone()


def partial_terms(x: torch.Tensor, mesh_shape, placements, g: torch.Generator) -> dict[tuple, torch.Tensor] | None:
    """Random per-rank terms whose reduction over every Partial mesh dim is ``x`` (exactly)."""
    pdims = [j for j, p in enumerate(placements) if isinstance(p, Partial)]
    if not pdims:
        return None
    kinds = {placements[j].reduce_op for j in pdims}
    assert len(kinds) == 1, "one Partial kind per tensor"
    kind = kinds.pop()
    combos = list(itertools.product(*[range(mesh_shape[j]) for j in pdims]))
    n = len(combos)
    if kind in ("sum", "avg"):
        total = x * n if kind == "avg" else x
        if x.is_floating_point():
            fine = bool(((x * 2) != torch.round(x * 2)).any())
            terms = [dyadic(x.shape, g, 2.0, RES if fine else 2.0).to(x.dtype) for _ in range(n - 1)]
        else:
            terms = [torch.randint(-3, 4, x.shape, generator=g).to(x.dtype) for _ in range(n - 1)]
        terms.append(total - sum(terms) if terms else total.clone())
    elif kind in ("max", "min"):
        sign = 1 if kind == "max" else -1
        if x.dtype == torch.bool:
            terms = [x & (torch.rand(x.shape, generator=g) > 0.5) if kind == "max" else
                     x | (torch.rand(x.shape, generator=g) > 0.5) for _ in range(n)]
        else:
            terms = [x - sign * (dyadic(x.shape, g).abs() + 1.0 / RES).to(x.dtype) for _ in range(n)]
        who = torch.randint(0, n, x.shape, generator=g)
        terms = [torch.where(who == i, x, t) for i, t in enumerate(terms)]
    elif kind == "product":
        terms = [torch.ones_like(x) for _ in range(n - 1)] + [x.clone()]
        perm = torch.randperm(n, generator=g).tolist()
        terms = [terms[i] for i in perm]
    else:
        raise ValueError(kind)
    return dict(zip(combos, (t.to(x.dtype) for t in terms)))


def _options(t: torch.Tensor, partial: Sequence[str]) -> list:
    opts = [Replicate()] + [Shard(d) for d in range(t.ndim)]
    if t.dtype == torch.bool:
        partial = [k for k in partial if k in ("max", "min")]
    elif not t.is_floating_point():
        partial = [k for k in partial if k != "avg"]
    return opts + [Partial(k) for k in partial]


def _leaves(values: Sequence[Any]) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def placement_combos(tensors: Sequence[torch.Tensor], mesh_shape, limit: int | None, seed: Any,
                     partial: Sequence[str] | Sequence[Sequence[str]] = ("sum",)) -> list[tuple]:
    """All per-input placement combinations, or ``limit`` of them at random (all-R always kept).

    ``partial``: the Partial kinds to try, for every input or (a list of lists) per input.
    """
    if partial and not isinstance(partial[0], str) and partial[0] is not None:
        per = list(partial)
    else:
        per = [tuple(partial or ())] * len(tensors)
    per_input = [[c for c in itertools.product(_options(t, kinds or ()), repeat=len(mesh_shape))
                  if len({p.reduce_op for p in c if isinstance(p, Partial)}) <= 1]
                 for t, kinds in zip(tensors, per)]
    total = 1
    for opts in per_input:
        total *= len(opts)
    rng = random.Random(_seed(seed, mesh_shape))
    if limit is None or total <= limit:
        return list(itertools.product(*per_input))
    if total > 100_000:  # never materialise a huge product: draw each input independently
        picked = []
        seen = set()
        while len(picked) < limit:
            c = tuple(rng.choice(opts) for opts in per_input)
            if c not in seen:
                seen.add(c)
                picked.append(c)
    else:
        picked = rng.sample(list(itertools.product(*per_input)), limit)
    allr = tuple(tuple(Replicate() for _ in mesh_shape) for _ in tensors)
    if allr not in picked:
        picked[-1] = allr
    return picked


@dataclass
class Prepared:
    value: Any
    placements: tuple | None = None
    terms: dict | None = None


def prepare(values, combo, mesh_shape, g) -> list:
    it = iter(combo)

    def one(v):
        if isinstance(v, torch.Tensor):
            pl = tuple(next(it))
            return Prepared(v, pl, partial_terms(v, mesh_shape, pl, g))
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            return type(v)(one(x) for x in v)
        return Prepared(v)

    return [one(v) for v in values]


@dataclass(frozen=True)
class Api:
    """The DTensor implementation a rank runs: shardtensor's (``SHARDTENSOR``), or another one
    with the same shape of API (the OpInfo sweep passes PyTorch's).  Placements are given and
    returned as shardtensor's placement objects."""

    mesh: Callable[[tuple], Any]
    from_local: Callable[..., Any]  # (local, mesh, placements, shape, stride) -> DTensor
    dtensor: type
    placements: Callable[[Any], tuple]
    shard_order: Callable[[Any], Any]


SHARDTENSOR = Api(lambda shape: init_device_mesh("cpu", shape),
                  lambda local, mesh, pl, shape, stride: DTensor.from_local(local, mesh, list(pl), shape=shape,
                                                                            stride=stride),
                  DTensor, lambda o: tuple(o.placements), lambda o: o.shard_order)


def make_dtensor(p, mesh, grad: bool, api: Api = SHARDTENSOR):
    if isinstance(p, (list, tuple)):
        return type(p)(make_dtensor(x, mesh, grad, api) for x in p)
    if p.placements is None:
        return p.value
    coord = tuple(mesh.get_coordinate())
    src = p.value
    if p.terms is not None:
        src = p.terms[tuple(c for c, pl in zip(coord, p.placements) if isinstance(pl, Partial))]
    local = local_piece(src, tuple(mesh.shape), coord, p.placements)
    d = api.from_local(local, mesh, p.placements, p.value.shape, p.value.stride())
    if grad and d.is_floating_point():
        d.requires_grad_()
    return d


def _describe(case) -> str:
    def one(p):
        if isinstance(p, (list, tuple)):
            return "[" + ", ".join(one(x) for x in p) + "]"
        if p.placements is None:
            return repr(p.value) if not isinstance(p.value, torch.Tensor) else "tensor"
        return "(" + ", ".join(map(str, p.placements)) + ")"

    return ", ".join(one(p) for p in case)


def _flat_outputs(out) -> list:
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


def _dt_leaves(args, api: Api = SHARDTENSOR) -> list:
    out = []
    for a in args:
        if isinstance(a, api.dtensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, api.dtensor))
    return out


def _rank_run(mesh_shape, cases, fn, grad, weights, api: Api = SHARDTENSOR):
    mesh = api.mesh(tuple(mesh_shape))
    coord = tuple(mesh.get_coordinate())
    results = []
    for case in cases:
        try:
            args = [make_dtensor(p, mesh, grad, api) for p in case]
            outs = _flat_outputs(fn(*args))
            rec = []
            for o in outs:
                if o is None or not isinstance(o, torch.Tensor):
                    rec.append(None)
                    continue
                assert isinstance(o, api.dtensor), f"an output is {type(o).__name__}, not a DTensor"
                with torch.no_grad():
                    local = o.to_local().clone()
                rec.append((api.placements(o), local, o.full_tensor().detach(), api.shard_order(o)))
            grads = None
            if grad and weights is not None:
                loss = None
                for o, w in zip(outs, weights):
                    if w is not None and isinstance(o, api.dtensor):
                        term = (o.full_tensor() * w).sum()
                        loss = term if loss is None else loss + term
                if loss is not None and loss.requires_grad:
                    loss.backward()
                    grads = [a.grad.full_tensor().detach() if a.grad is not None else None
                             for a in _dt_leaves(args, api)]
            results.append((rec, grads, coord))
        except BaseException as e:
            e.add_note(f"placements of the inputs: {_describe(case)}")
            raise
    return results


def _gloo_rank(rank, world, mesh_shape, cases, fn, grad, weights):
    torch.set_num_threads(1)
    return _rank_run(mesh_shape, cases, fn, grad, weights)


def _dense(fn, values, grad: bool):
    def leaf(v):
        if isinstance(v, torch.Tensor):
            v = v.clone()
            return v.requires_grad_() if grad and v.is_floating_point() else v
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            return type(v)(leaf(x) for x in v)
        return v

    leaves = [leaf(v) for v in values]
    return fn(*leaves), leaves


def close(actual, expected, what: str, tol: dict | None) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    kw = tol or ({} if not actual.is_floating_point() else dict(rtol=1e-5, atol=1e-5))
    torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{what}: {m}", **kw)


def check(fn: Callable, values: Sequence[Any], mesh_shape, *, limit: int | None = 12, grad: bool = True,
          partial: Sequence[str] | Sequence[Sequence[str]] = ("sum",), tol: dict | None = None,
          grad_tol: dict | None = None, combos: list | None = None, seed: Any = 0, world: str = "sim",
          compare: Callable | None = None, runner: Callable | None = None,
          grad_compare: Callable | None = None) -> list:
    """Run ``fn`` on DTensors for many placement combinations and compare with dense torch.

    ``compare(actual_full, expected, i)`` replaces the value check of output ``i`` (e.g. for
    outputs defined up to sign, indices with ties, or random ops checked by property); the ranks
    must still agree on the whole value and hold their pieces of it.  ``grad_compare(actual,
    expected, k)`` likewise replaces the check of input ``k``'s gradient.  ``runner(mesh_shape, cases, fn, grad,
    weights)`` replaces the world: it returns, per rank, what ``_rank_run`` returns (the OpInfo
    sweep runs PyTorch's DTensor through it).
    """
    tensors = _leaves(values)
    if combos is None:
        combos = placement_combos(tensors, mesh_shape, limit, (seed, "combos"), partial)
    g = gen((seed, "terms", tuple(mesh_shape)))
    cases = [prepare(values, c, mesh_shape, g) for c in combos]

    dense_out, leaves = _dense(fn, values, grad)
    dense_outs = _flat_outputs(dense_out)
    dense_leaves = _leaves(leaves)
    weights = None
    dense_grads = None
    if grad and any(t.requires_grad for t in dense_leaves):
        weights = [dyadic(o.shape, gen((seed, "w", i))).to(o.dtype)
                   if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad else None
                   for i, o in enumerate(dense_outs)]
        loss = None
        for o, w in zip(dense_outs, weights):
            if w is not None:
                loss = (o * w).sum() if loss is None else loss + (o * w).sum()
        if loss is not None:
            loss.backward()
            dense_grads = [t.grad for t in dense_leaves]
        else:
            weights = None
    dense_outs = [o.detach() if isinstance(o, torch.Tensor) else o for o in dense_outs]

    n = 1
    for s in mesh_shape:
        n *= s
    if runner is not None:
        per_rank = runner(mesh_shape, cases, fn, grad, weights)
    elif world == "sim":
        per_rank = run_spmd(_rank_run, n, mesh_shape, cases, fn, grad, weights, timeout=TIMEOUT)
    elif world == "gloo":
        try:
            from distributed import run_multiprocess
        except ImportError:
            from tests.distributed import run_multiprocess
        per_rank = run_multiprocess(_gloo_rank, n, timeout=120, args=(mesh_shape, cases, fn, grad, weights))
    else:
        raise ValueError(world)

    seen = []
    for i, case in enumerate(cases):
        desc = _describe(case)
        rec0 = per_rank[0][i][0]
        out_pls = tuple(r[0] if r is not None else None for r in rec0)
        assert len(rec0) == len(dense_outs), f"inputs {desc}: {len(rec0)} outputs, dense gives {len(dense_outs)}"
        for rank, res in enumerate(per_rank):
            rec, grads, coord = res[i]
            for k, (r, expected) in enumerate(zip(rec, dense_outs)):
                if expected is None or not isinstance(expected, torch.Tensor):
                    continue
                assert r is not None, f"inputs {desc}: output {k} missing"
                pl, local, full, order = r
                what = f"inputs {desc} -> output {k} {pl}, rank {rank}"
                assert pl == out_pls[k], f"{what}: ranks disagree on output placements ({out_pls[k]} on rank 0)"
                if compare is not None:
                    compare(full, expected, k)
                    close(full, rec0[k][2], f"{what}: full_tensor against rank 0's", None)
                    expected = full
                else:
                    close(full, expected, f"{what}: full_tensor", tol)
                if not any(isinstance(p, Partial) for p in pl):
                    close(local, local_piece(expected, mesh_shape, coord, pl, order),
                           f"{what}: local shard (shard order {order})", tol)
            if dense_grads is not None:
                assert grads is not None, f"inputs {desc}: no backward ran on rank {rank}"
                for k, (gd, ga) in enumerate(zip(dense_grads, grads)):
                    if gd is None:
                        continue
                    assert ga is not None, f"inputs {desc}: input {k} got no gradient (rank {rank})"
                    if grad_compare is not None:
                        grad_compare(ga, gd, k)
                    else:
                        close(ga, gd, f"inputs {desc}: grad of input {k}, rank {rank}", grad_tol or tol)
        seen.append((tuple(p for p in combos[i]), out_pls if len(out_pls) > 1 else out_pls[0]))
    return seen
