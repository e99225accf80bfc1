"""Candidates and their selection: the part of propagation every strategy-style rule shares.

A rule that has a choice lists :class:`Candidate` s -- the placements it needs on (some of)
its tensor arguments and the placements of its outputs -- and :func:`decide` picks one:

- the cost of a candidate is the modeled alpha-beta time of the plans the redistribute
  planner will actually run to bring each input to its required placements (memoized per
  (current spec, required placements)), so selection and execution agree;
- the minimum wins; ties go to the first candidate that needs no data movement at all, then to
  the first in enumeration order (deterministic on every rank and every run);
- a minimum of infinity (e.g. every candidate needs Shard -> Partial) raises, naming the op
  and the placements.

Output specs are built fresh from the output metadata (global shape, stride, dtype), so a
cached decision never shares mutable state with a later call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Sequence

import torch

from ..errors import PropagationError
from ..placement import Partial, Placement, Replicate, Shard, display
from ..spec import DTensorSpec

__all__ = ["Candidate", "decide", "select", "input_cost", "out_specs", "replicate", "placements_of"]

Pl = tuple[Placement, ...]


@dataclass(frozen=True)
class Candidate:
    """One way to run an op: required placements per tensor argument and output placements.

    ``inputs`` maps a flat argument position (see ``Call.pos``) to the placements it must have;
    tensor arguments not listed keep their current spec.  ``output`` mirrors the op's output:
    a placements tuple for one tensor, a tuple/list of those (``None`` for a non-tensor or an
    absent output), or ``None``.
    """

    inputs: dict[int, Pl] = field(default_factory=dict)
    output: Any = None


def replicate(mesh_ndim: int) -> Pl:
    return (Replicate(),) * mesh_ndim


def placements_of(spec: DTensorSpec) -> Pl:
    return spec.placements


@lru_cache(maxsize=16384)
def input_cost(src: DTensorSpec, placements: Pl) -> float:
    """Modeled seconds to move ``src`` to ``placements`` (the planner's own plan); inf if impossible."""
    if src.placements == placements:
        return 0.0
    from ..redistribute.cost import plan_cost
    from ..redistribute.planner import plan_for

    mesh = src.mesh
    for j, (a, b) in enumerate(zip(src.placements, placements)):
        if isinstance(b, Partial) and isinstance(a, Shard) and mesh.shape[j] > 1:
            return math.inf
    try:
        dst = src.with_placements(placements)
    except (ValueError, TypeError):
        return math.inf
    steps = plan_for(src, dst)
    return plan_cost(steps, src.shape, mesh.shape, max(src.dtype.itemsize, 1))[1]


def _cost(call, cand: Candidate) -> float:
    total = 0.0
    for pos, pl in cand.inputs.items():
        s = call.specs[pos]
        if s is None:
            raise ValueError(f"{call.op}: candidate requires placements for argument {pos}, which is not a DTensor")
        if len(pl) != s.mesh.ndim:
            raise ValueError(f"{call.op}: candidate gives {len(pl)} placements for a {s.mesh.ndim}-D mesh")
        total += input_cost(s, tuple(pl))
    return total


def _moves(call, cand: Candidate) -> bool:
    return any(call.specs[pos].placements != tuple(pl) for pos, pl in cand.inputs.items())


def select(call, cands: Sequence[Candidate]) -> Candidate:
    """The cheapest candidate (ties: first zero-movement one, then first listed)."""
    if not cands:
        raise PropagationError(_msg(call, "has no valid sharding candidate"))
    if len(cands) == 1:
        best, cost = cands[0], _cost(call, cands[0])
    else:
        costs = [_cost(call, c) for c in cands]
        cost = min(costs)
        best = None
        if cost == 0.0:
            best = next((c for c, k in zip(cands, costs) if k == 0.0 and not _moves(call, c)), None)
        if best is None:
            best = cands[costs.index(cost)]
    if math.isinf(cost):
        raise PropagationError(_msg(call, "has no candidate reachable from the inputs' placements"))
    assert best is not None
    return best


def _msg(call, why: str) -> str:
    pls = [display(s.placements, s.shard_order) for s in call.specs if s is not None]
    return f"shardtensor: {call.op} {why} (input placements: {', '.join(pls)})"


def out_specs(mesh, meta: Any, pl: Any) -> Any:
    """Output spec(s) from metadata and placements of the same structure."""
    if pl is None or meta is None:
        return None
    if isinstance(meta, torch.Tensor):
        if isinstance(pl, (tuple, list)) and pl and not isinstance(pl[0], Placement):
            raise ValueError(f"one tensor output but placements for several: {pl!r}")
        return DTensorSpec.build(mesh, pl, meta.shape, meta.stride(), meta.dtype)
    if isinstance(meta, (tuple, list)):
        if isinstance(pl, (tuple, list)) and pl and isinstance(pl[0], Placement):
            pl = [pl if isinstance(m, torch.Tensor) else None for m in meta]
        if len(pl) != len(meta):
            raise ValueError(f"{len(meta)} outputs but {len(pl)} output placements")
        return type(meta)(out_specs(mesh, m, p) for m, p in zip(meta, pl))
    return None


def decide(call, cands: Sequence[Candidate] | Candidate, *, kernel: Callable | None = None,
           local_args: Callable | None = None, meta: Any = None):
    """Select a candidate and turn it into a cached-safe :class:`Decision`."""
    from . import Decision

    cand = cands if isinstance(cands, Candidate) else select(call, cands)
    inputs = list(call.specs)
    redistribute = False
    for pos, pl in cand.inputs.items():
        s = call.specs[pos]
        pl = tuple(pl)
        if s.placements != pl or not s.is_default_order:
            # outputs are labelled with the default shard order, so inputs must have it too
            inputs[pos] = s.with_placements(pl)
            redistribute = True
    output = out_specs(call.mesh, call.out_meta if meta is None else meta, cand.output)
    return Decision(tuple(inputs), output, redistribute, local_args, kernel)
