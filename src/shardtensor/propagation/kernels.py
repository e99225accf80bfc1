"""Local kernels that talk to other ranks: rules attach them to decisions, dispatch runs them.

Rules decide; they never run anything.  Where a decision's local step needs other ranks (a
global statistic, random numbers every rank agrees on, a row one rank holds), the rule builds
its kernel with a function here and attaches it.  Every collective a rule's kernel runs is in
this file; ``tests/test_layers.py`` keeps the rule modules from importing ``comm``, ``rng`` or
``redistribute``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .. import comm, rng
from ..redistribute import redistribute_local
from ..spec import DTensorSpec

__all__ = ["histc", "multinomial", "equal", "global_fill", "random_like", "random_fill", "bernoulli", "nll_mean",
           "draw_seed", "variance", "select_row", "uniform_dtype"]


# -- statistics over the mesh --------------------------------------------------------------

def _histc_bounds(x: torch.Tensor, lo: float, hi: float, mesh: Any, sharded: bool) -> tuple[float, float]:
    """torch's bounds: the data's global min and max when ``min == max``, widened by 1 if still equal.

    One all-reduce (max of ``(-min, max)``) over the mesh when the data is sharded: replicated mesh
    dims hold the same values, so the whole mesh gives the same extremes."""
    if lo == hi:
        ends = (torch.stack([-x.min(), x.max()]).to(torch.float64) if x.numel()
                else torch.full((2,), -float("inf"), dtype=torch.float64, device=x.device))
        if sharded:
            ends = comm.all_reduce(ends, "max", mesh, None)
        lo, hi = (-float(ends[0]), float(ends[1])) if torch.isfinite(ends[0]) else (0.0, 0.0)
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    return lo, hi


def histc(mesh: Any, sharded: bool) -> Callable:
    """``histc`` of this rank's values, within the bounds of the global data (see ``_histc_bounds``)."""
    def kernel(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
        lo, hi = _histc_bounds(x, float(min), float(max), mesh, sharded)
        return torch.histc(x, bins, lo, hi)

    return kernel


def equal(mesh: Any) -> Callable:
    """``torch.equal`` of like-placed shards: each rank compares its own, a min all-reduce agrees."""
    def kernel(x: torch.Tensor, y: torch.Tensor) -> bool:
        same = torch.tensor([1 if torch.equal(x, y) else 0], dtype=torch.int32, device=x.device)
        return bool(comm.all_reduce(same, "min", mesh, None).item())

    return kernel


def nll_mean(op: Any, mesh: Any, dims: list[int]) -> Callable:
    """Local summed loss over the all-reduced total weight: a ``P(sum)`` term of the mean."""
    def kernel(self, target, weight=None, reduction=1, ignore_index=-100):
        s, tw = op(self, target, weight, 2, ignore_index)
        total = tw
        for j in dims:
            total = comm.all_reduce(total, "sum", mesh, j)
        return s / total, total
    return kernel


def variance(mesh: Any, J: list[int], D: Sequence[int], keepdim: bool, n_global: int, denom: int, is_std: bool,
                partial_out: bool, out_dtype: torch.dtype) -> Callable:
    """Two-pass variance over a sharded ``D``: all-reduce ``sum x`` for the mean, then the
    local ``sum |x - mean|^2 / denom`` is a Partial(sum) term (all-reduced for std)."""
    dims = list(D)

    def kernel(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        xa = x.to(acc)
        total = xa.sum(dim=dims, keepdim=True)
        for j in J:
            total = comm.all_reduce(total, "sum", mesh, j)
        mu = total / n_global
        dev = xa - mu
        sq = (dev.real.square() + dev.imag.square()) if dev.is_complex() else dev.square()
        m2 = sq.sum(dim=dims, keepdim=keepdim)
        if not partial_out:
            for j in J:
                m2 = comm.all_reduce(m2, "sum", mesh, j)
        var = m2 / denom if denom > 0 else m2 / 0.0
        if is_std:
            var = var.sqrt()
        return var.to(out_dtype)

    return kernel


def select_row(mesh: Any, dim: int, owners: list[tuple[int, int]], local_index: int) -> Callable:
    """``select`` of a row on a sharded ``dim``: the rank at ``owners`` (``(mesh dim, coordinate)``
    pairs) selects it and broadcasts it over those mesh dims."""
    def kernel(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        coord = mesh.get_coordinate()
        shape = list(x.shape)
        del shape[dim]
        if all(coord[j] == r for j, r in owners):
            row = x.select(dim, local_index).contiguous()
        else:
            row = x.new_empty(shape)
        wire = row.to(torch.uint8) if row.dtype == torch.bool else row
        for j, r in reversed(owners):
            wire = comm.broadcast(wire, r, mesh, j)
        return wire.to(torch.bool) if row.dtype == torch.bool else wire

    return kernel


# -- random numbers every rank agrees on (``shardtensor.rng``) -------------------------------

def draw_seed(mesh: Any, generator: torch.Generator | None = None,
              device: torch.device | None = None) -> tuple[int, int]:
    """One seed per call, the same on every rank of ``mesh``, drawn as ``shardtensor.rng`` draws."""
    t = rng.draw(mesh, generator, device, lambda g: torch.randint(0, 2 ** 31, (2,), generator=g, dtype=torch.int64,
                                                                  device=g.device))
    return int(t[0]), int(t[1])


def _piece(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    shape, off = spec.local_shape_and_offset()
    for d, (n, o) in enumerate(zip(shape, off)):
        if n != full.shape[d]:
            full = full.narrow(d, min(o, full.shape[d]), n)
    return full


def global_fill(spec: DTensorSpec, like: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None,
                 fill: Callable[[torch.Tensor, torch.Generator], Any]) -> torch.Tensor:
    """This rank's block of ``fill`` run on the global tensor, drawn as one device would (see ``rng``)."""
    def one_device(g: torch.Generator) -> torch.Tensor:
        full = torch.empty_strided(tuple(spec.shape), tuple(spec.stride), dtype=dtype, device=like.device)
        fill(full, g)
        return full

    return _piece(rng.draw(spec.mesh, generator, like.device, one_device), spec)


def random_like(op: Any, out: DTensorSpec, methods: dict) -> Callable:
    """``rand_like`` & co.: this rank's block of the global tensor filled by ``methods[op]`` (a
    ``Tensor`` method name), else by ``random_(low, high)`` (``randint_like``)."""
    def kernel(x: torch.Tensor, *args: Any, generator: torch.Generator | None = None, **kw: Any) -> torch.Tensor:
        def fill(full: torch.Tensor, g: torch.Generator) -> None:
            if op in methods:
                getattr(full, methods[op])(generator=g)
            else:
                low, high = (0, args[0]) if len(args) == 1 else args[:2]
                full.random_(low, high, generator=g)

        return global_fill(out, x, out.dtype, generator, fill).clone()

    return kernel


def random_fill(op: Any, s: DTensorSpec) -> Callable:
    """In-place random fill ``op``: this rank's block of the fill of the global tensor (a
    Partial self holds it as terms of the value)."""
    whole = s.unpartial()

    def kernel(x: torch.Tensor, *args: Any, generator: torch.Generator | None = None, **kw: Any) -> torch.Tensor:
        u = global_fill(s, x, x.dtype, generator, lambda full, g: op(full, *args, generator=g, **kw))
        return x.copy_(redistribute_local(u, whole, s))

    return kernel


def uniform_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of the uniforms torch's CPU ``bernoulli`` with a probability tensor ``p``
    compares with it: float64 for float64 probabilities, float32 for the rest."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def bernoulli(s: DTensorSpec) -> Callable:
    """``x.bernoulli_(p)``: ``u < p`` with ``u`` this rank's block of one global uniform draw."""
    whole = s.unpartial()

    def kernel(x: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        u = global_fill(s, x, uniform_dtype(p), generator, lambda full, g: full.uniform_(generator=g))
        return x.copy_(redistribute_local((u < p).to(x.dtype), whole, s))

    return kernel


def _check_probabilities(rows: torch.Tensor, num_samples: int, replacement: bool, spec: DTensorSpec) -> None:
    """torch's checks, agreed over the mesh so that every rank raises together."""
    bad = 0
    if rows.numel() and (not torch.isfinite(rows).all() or (rows < 0).any() or (rows.sum(-1) <= 0).any()):
        bad = 1
    elif rows.numel() and not replacement and int((rows > 0).sum(-1).min()) < num_samples:
        bad = 2
    flag = comm.all_reduce(torch.tensor(bad, dtype=torch.int64, device=rows.device), "max", spec.mesh, None)
    if int(flag) == 1:
        raise RuntimeError("multinomial: probability tensor contains either inf, nan or element < 0, or a row "
                           "sums to 0 (on some rank)")
    if int(flag) == 2:
        raise RuntimeError("multinomial: cannot sample n_sample > prob_dist.size(-1) samples without replacement "
                           "(not enough non-zero categories on some rank)")


def multinomial(mesh: Any, need: DTensorSpec, shape: tuple, one_row: bool, out_shape: Sequence[int]) -> Callable:
    """``multinomial`` of this rank's rows (of a global ``shape``; ``one_row``: a 1-D input), with
    uniforms drawn once for the global rows and the input checks agreed over the mesh."""
    def kernel(p: torch.Tensor, num_samples: int, replacement: bool = False, *,
               generator: torch.Generator | None = None) -> torch.Tensor:
        rows = p.reshape(-1, p.shape[-1]).to(torch.float64)
        _check_probabilities(rows, num_samples, replacement, need)
        (n, *_), (o, *_) = ((1,), (0,)) if one_row else need.local_shape_and_offset()
        u_shape = (shape[0], num_samples) if replacement else shape
        u = rng.draw(mesh, generator, p.device,
                     lambda g: torch.rand(u_shape, generator=g, dtype=torch.float64, device=p.device)).narrow(0, o, n)
        if replacement:
            cdf = rows.cumsum(-1)
            idx = torch.searchsorted(cdf, (u * cdf[:, -1:]).contiguous(), right=True).clamp_(max=shape[1] - 1)
        else:
            keys = rows.log() - (-u.clamp_min(1e-300).log()).log()
            idx = keys.topk(num_samples, dim=-1).indices
        return idx.reshape(tuple(out_shape) if one_row else (p.shape[0], num_samples))

    return kernel
