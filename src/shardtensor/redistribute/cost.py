"""The alpha-beta cost model of redistribution plans (docs/redistribution.md).

A step changes the placement of one mesh dim ``j`` (``k = k_j`` ranks per group) and works
on the step's *logical shape* ``l``: the global shape with every sharding of the step's state
applied except mesh dim ``j``'s own.  Sizes are taken at coordinate 0 at every
level, i.e. the largest piece, which is also the padded size the collectives move; this makes
the cost rank independent.  With coordinate 0 a tensor dim ``d`` split by the mesh dims ``M``
has length ``ceil(L_d / prod(k_i, i in M))`` whatever their order (``ceil(ceil(a/b)/c) ==
ceil(a/(b*c))``).

Bytes sent per rank and latency terms of each transition: its row in ``moves.py`` (an
all-gather ``(k-1) c_d |X| / l_d``, an all-reduce ``2 (k-1) / k |X|``, ...; ``c_d = ceil(l_d / k)``).

Time of a step on mesh dim ``j``: ``launch_j + latency * alpha_j + bytes * beta_j`` for a
collective (``LinkModel`` per mesh dim; intra-host and inter-host links differ), 0 for a local
step.  ``alpha`` is the per-hop latency of a ring; ``launch`` is the fixed cost of issuing one
collective (library call, kernel launch, synchronisation), which the ring model leaves out and
which is what one collective over a flattened group of mesh dims saves (``FlatStep``: a ring
over ``K = prod k_j`` ranks; same formulas with ``k = K``, priced on the slowest link of its
dims).  Exact arithmetic: :func:`step_comm` returns the element count as a numerator over a
denominator (only the all-reduce is fractional).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from .moves import elements, move
from .steps import ExchangeStep

__all__ = ["LinkModel", "DEFAULT_LINK", "normalize_links", "logical_shape", "step_comm", "step_bytes",
           "step_time", "step_link", "link_of", "plan_cost"]


@dataclass(frozen=True)
class LinkModel:
    """Per-mesh-dim link: ``alpha`` seconds per latency term (ring hop), ``beta`` seconds per
    byte, ``launch`` seconds per collective issued."""

    alpha: float = 5e-6
    beta: float = 4e-11
    launch: float = 2e-5

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta >= 0 and self.launch >= 0):
            raise ValueError(f"LinkModel needs alpha >= 0, beta >= 0 and launch >= 0, got {self!r}")


DEFAULT_LINK = LinkModel()


def normalize_links(links, ndim: int) -> tuple[LinkModel, ...]:
    """``None`` -> the default link on every mesh dim; one ``LinkModel`` -> it on every dim."""
    if links is None:
        return (DEFAULT_LINK,) * ndim
    if isinstance(links, LinkModel):
        return (links,) * ndim
    links = tuple(links)
    if len(links) != ndim or not all(isinstance(x, LinkModel) for x in links):
        raise ValueError(f"links must be a LinkModel or one LinkModel per mesh dim ({ndim}), got {links!r}")
    return links


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def logical_shape(step, global_shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Coordinate-0 logical shape of ``step``: every sharding of its state but its own mesh dims'."""
    shape = list(global_shape)
    own = step.mesh_dims
    for d, js in step.order:
        div = 1
        for i in js:
            if i not in own:
                div *= mesh_shape[i]
        if div > 1:
            shape[d] = _cdiv(shape[d], div)
    return tuple(shape)


def _prod(xs: Iterable[int]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def step_comm(step, global_shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[str, int, int, int]:
    """``(kind, num, den, latency)``: the step sends ``num / den`` elements per rank (its row in
    ``moves.py``)."""
    if type(step) is ExchangeStep:
        from .exchange import exchange_comm

        num, lat = exchange_comm(tuple(global_shape), tuple(mesh_shape), step.dims, step.placements, step.order,
                                 step.target, step.target_order)
        return "all_to_all", num, 1, lat
    k = _prod(mesh_shape[i] for i in step.mesh_dims)
    m = move(step.src, step.dst, k)
    if not m.hops:
        return m.collective, 0, 1, 0
    num, den = elements(m, step.src, step.dst, logical_shape(step, global_shape, mesh_shape), k)
    return m.collective, num, den, m.hops * (k - 1)


def step_bytes(step, global_shape: Sequence[int], mesh_shape: Sequence[int], itemsize: int) -> float:
    """Bytes one rank sends in ``step`` (padded pieces; the all-reduce may be fractional)."""
    _, num, den, _ = step_comm(step, global_shape, mesh_shape)
    return num * itemsize / den if den != 1 else float(num * itemsize)


def step_link(step, links: Sequence[LinkModel]) -> LinkModel:
    """The link a step runs on: its mesh dim's, or the slowest of a flattened group's."""
    return link_of(step.mesh_dims, links)


def link_of(dims: Sequence[int], links: Sequence[LinkModel]) -> LinkModel:
    """The link of a collective over ``dims``: one mesh dim's, or the slowest of each term."""
    if len(dims) == 1:
        return links[dims[0]]
    return LinkModel(max(links[i].alpha for i in dims), max(links[i].beta for i in dims),
                     max(links[i].launch for i in dims))


def step_time(step, global_shape, mesh_shape, itemsize: int, link: LinkModel) -> float:
    _, num, den, lat = step_comm(step, global_shape, mesh_shape)
    if not lat:
        return 0.0
    return link.launch + lat * link.alpha + link.beta * (num * itemsize / den)


def plan_cost(steps, global_shape: Sequence[int], mesh_shape: Sequence[int], itemsize: int,
              links=None) -> tuple[float, float]:
    """``(bytes sent per rank, modeled seconds)`` of a plan (any planner's ``Step`` tuple)."""
    lk = normalize_links(links, len(mesh_shape))
    total_bytes = 0.0
    total_time = 0.0
    for st in steps:
        _, num, den, lat = step_comm(st, global_shape, mesh_shape)
        if not lat:
            continue
        b = num * itemsize / den
        total_bytes += b
        link = step_link(st, lk)
        total_time += link.launch + lat * link.alpha + link.beta * b
    return total_bytes, total_time

