"""What every rule shares: candidates, their selection, and the one way a Decision is built.

A rule that has a choice lists :class:`Candidate` s -- the placements it needs on (some of)
its tensor arguments and the placements of its outputs -- and :func:`decide` picks one:

- the cost of a candidate is the modeled alpha-beta time of the plans the redistribute
  planner will actually run to bring each input to its required placements (memoized per
  (current spec, required placements)), so selection and execution agree;
- the minimum wins; ties go to the first candidate that needs no data movement at all, then to
  the first in enumeration order (deterministic on every rank and every run);
- a minimum of infinity (e.g. every candidate needs Shard -> Partial) raises, naming the op
  and the placements.

:func:`finish` is the one place a :class:`Decision` is built from required placements; the
shard order of a moved input is a policy (the default order, :func:`kept_order`, or a rule's
own).  Rules that think per mesh dim write :data:`Option` rows and :func:`expand` them into
candidates.  Output specs are built fresh from the output metadata (global shape, stride,
dtype), so a cached decision never shares mutable state with a later call.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Sequence

import torch

from ..errors import PropagationError
from ..placement import Placement, Replicate, Shard, shard_dim
from ..spec import DTensorSpec, placements_text, same_local
from .call import Decision

__all__ = ["Candidate", "decide", "finish", "select", "pick", "shard_instead", "expand", "dedupe", "input_cost", "out_specs",
           "replicate", "placements_of", "kept_order", "keep_order", "linear_partial", "any_partial", "no_partial", "compatible_kinds", "LINEAR_KINDS",
           "Pl", "Option", "Order"]

Pl = tuple[Placement, ...]
"""Placements over the whole mesh, one per mesh dim."""
Order = tuple[tuple[int, tuple[int, ...]], ...]
"""A shard order: ``((tensor dim, mesh dims in split order), ...)``."""
OrderFn = Callable[[int, DTensorSpec, Pl], "Order | None"]
"""A shard-order policy: ``(flat position, current spec, new placements) -> order`` (None: default)."""
Option = tuple[dict[int, Placement], Any]
"""One per-mesh-dim choice: required placement per flat position, and the output placement (a
tuple of placements, one per output, for an op with several outputs)."""

LINEAR_KINDS = ("sum", "avg")
"""Partial kinds whose combine is linear: sums of terms may be added, scaled and split."""


def linear_partial(p: Placement) -> bool:
    """A plain Partial whose combine is linear (sum or avg); norm partials are not."""
    return p.plain_op() in LINEAR_KINDS


def any_partial(p: Placement) -> bool:
    """For ops that move values without combining them: every Partial kind passes."""
    return True


def no_partial(p: Placement) -> bool:
    """For ops that combine values non-linearly: every Partial is reduced first."""
    return False


def compatible_kinds(out: Sequence[Placement]) -> bool:
    """Partials on several mesh dims must commute: only {sum, avg} mix, else all equal."""
    parts = [p for p in out if p.is_partial()]
    if len(parts) < 2:
        return True
    if all(linear_partial(p) for p in parts):
        return True
    return all(p == parts[0] for p in parts)


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
    from ..redistribute.moves import move
    from ..redistribute.planner import plan_for

    mesh = src.mesh
    if not all(move(a, b, k).forward for a, b, k in zip(src.placements, placements, mesh.shape)):
        return math.inf  # a move the forward refuses (S -> P)
    try:
        dst = src.with_placements(placements)
    except (ValueError, TypeError):
        return math.inf
    steps = plan_for(src, dst)
    return plan_cost(steps, src.shape, mesh.shape, max(src.dtype.itemsize, 1))[1]


def kept_order(spec: DTensorSpec, pl: Sequence[Placement]) -> Order:
    """The shard order for ``pl`` that keeps ``spec``'s order where the same mesh dims still shard a dim."""
    m = len(pl)
    order = []
    done = set()
    for d, js in spec.shard_order:
        here = Shard(d)
        keep = tuple(j for j in js if pl[j] == here)
        new = tuple(j for j in range(m) if pl[j] == here and j not in keep)
        if keep or new:
            order.append((d, keep + new))
            done.add(d)
    for j, p in enumerate(pl):
        e = shard_dim(p)
        if e is not None and e not in done:
            order.append((e, tuple(i for i in range(m) if pl[i] == p)))
            done.add(e)
    return tuple(sorted(order))


def keep_order(pos: int, spec: DTensorSpec, pl: Pl) -> Order:
    """Shard-order policy for :func:`finish`: :func:`kept_order` (as reductions need)."""
    return kept_order(spec, pl)


def expand(options: Sequence[Sequence[Option]], positions: Sequence[int],
           valid: Callable[[Candidate], bool] | None = None) -> list[Candidate]:
    """Cartesian product of per-mesh-dim options into mesh-wide candidates (invalid ones dropped).

    An option's output is one placement, or a tuple of them for an op with several outputs (the
    candidate's output is then a list of placements per output)."""
    cands = []
    for combo in itertools.product(*options):
        inputs = {pos: tuple(opt[0].get(pos, Replicate()) for opt in combo) for pos in positions}
        out: Any = tuple(opt[1] for opt in combo)
        if out and isinstance(out[0], tuple):
            out = [tuple(o[i] for o in out) for i in range(len(out[0]))]
            if not all(compatible_kinds(o) for o in out):
                continue
        elif not compatible_kinds(out):
            continue
        cand = Candidate(inputs, out)
        if valid is None or valid(cand):
            cands.append(cand)
    return cands


def dedupe(cands: Sequence[Candidate]) -> Sequence[Candidate]:
    """``cands`` without repeats (the first of equal candidates kept, so selection is unchanged);
    fewer than two are returned as they are (most rules give one: nothing to key)."""
    if len(cands) < 2:
        return cands
    out, seen = [], set()
    for c in cands:
        key = (tuple(sorted(c.inputs.items())), repr(c.output))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


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


def pick(call, pos: int, options: Sequence[Pl]) -> Pl:
    """The cheapest of ``options`` for argument ``pos`` alone (ties: first listed)."""
    if len(options) == 1:
        return tuple(options[0])
    return tuple(select(call, [Candidate({pos: o}) for o in options]).inputs[pos])


def shard_instead(call, pos: int, base: Sequence[Placement], dims: Sequence[int], *, alone: bool = False) -> Pl:
    """``base`` (argument ``pos``'s required placements), or, on a mesh dim where ``base`` gathers
    or reduces, one of ``dims`` sharded instead (an all-to-all, a reduce-scatter); where ``base``
    moves anything, a kept Partial may be reduce-scattered into one of ``dims`` too, so the move
    carries a smaller piece.  Whichever the engine prices cheapest (ties: ``base``); only dims
    with a piece for every rank.  A Partial becomes a shard only where the input is sharded on
    another mesh dim (alone, it is reduced whole, as elementwise ops do: docs/propagation.md),
    or ``alone`` (ops whose output the next op rarely needs whole: softmax rows, histograms)."""
    s = call.specs[pos]
    moves = any(a != b for a, b in zip(s.placements, base))
    sharded = {j for j, a in enumerate(s.placements) if a.is_shard()}
    per_dim: list[list[Placement]] = []
    for j, (a, b) in enumerate(zip(s.placements, base)):
        opens = (a != b or (moves and b.is_partial())) and (not a.is_partial() or alone or bool(sharded - {j}))
        alts = [Shard(d) for d in dims if s.shape[d] >= s.mesh.shape[j] > 1 and Shard(d) != b] if opens else []
        per_dim.append([b, *alts])
    options = list(itertools.islice(itertools.product(*per_dim), 64))
    return tuple(base) if len(options) == 1 else pick(call, pos, options)


def _msg(call, why: str) -> str:
    return f"shardtensor: {call.op} {why} (input placements: {placements_text(call.specs)})"


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


def finish(call, required: dict[int, Pl] | dict[int, DTensorSpec], output: Any, *, order: OrderFn | None = None,
           kernel: Callable | None = None, local_args: Callable | None = None,
           reorder_all: bool = False):
    """The :class:`Decision` that moves each ``required`` position to its placements (or spec).

    A moved input takes the shard order ``order`` gives (the default order when None; :func:`keep_order`
    keeps its own where the same mesh dims still shard); every
    other input keeps its spec, unless ``reorder_all`` moves kept inputs with a non-default
    order to the default one (for rules whose outputs are labelled in the default order).
    """
    inputs = list(call.specs)
    moved = False
    for pos, need in required.items():
        s = call.specs[pos]
        if isinstance(need, DTensorSpec):
            want = need
        else:
            pl = tuple(need)
            want = s.with_placements(pl, None if order is None else order(pos, s, pl))
        if want != s:
            inputs[pos] = want
            moved = moved or not same_local(s, want)
    if reorder_all:
        for i, s in enumerate(inputs):
            if s is not None and not s.is_default_order:
                inputs[i] = s.with_placements(s.placements)
                moved = moved or not same_local(s, inputs[i])
    return Decision(tuple(inputs), output, moved, local_args, kernel)


def decide(call, cands: Sequence[Candidate] | Candidate, *, kernel: Callable | None = None,
           kernel_for: Callable[[Candidate], Callable | None] | None = None, local_args: Callable | None = None,
           meta: Any = None):
    """Select a candidate and :func:`finish` it; outputs are built from the output metadata.

    Outputs carry the default shard order, so every input is brought to it (an input kept as
    it is, but split in another order, would mislabel the outputs).  ``kernel_for(chosen)``
    gives a custom local step that depends on the chosen candidate.
    """
    cand = cands if isinstance(cands, Candidate) else select(call, dedupe(cands))
    if kernel_for is not None:
        kernel = kernel_for(cand)
    output = out_specs(call.mesh, call.out_meta if meta is None else meta, cand.output)
    return finish(call, cand.inputs, output, kernel=kernel, local_args=local_args, reorder_all=True)
