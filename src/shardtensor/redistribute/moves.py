"""The moves of one mesh dim between the planner's placements, as rows of data.

The collective planner moves placements of three kinds, each asked of the placement
(``is_replicate()``, ``is_shard()``, ``is_partial()``): R, S and P.  One row per pair of kinds
says which collective moves the data, which tensor dims its blocks are split on, how many ring
passes it makes and why no plan does better; the cost model, the executor, the steps' names and
the explanation all read these rows, so each transition is written once.

With ``k`` ranks in the group, the step's logical shape ``l`` and ``|X| = prod(l)`` elements,
a row sends ``hops * (k-1) * prod(l')`` elements per rank, where ``l'`` is ``l`` with its
``split`` dims cut to ``ceil(l_d / k)`` (the padded pieces the collective moves), divided by
``k`` when nothing is split (the all-reduce's share); its latency is ``hops * (k-1)`` ring
steps.  Unpadded that is ``hops (k-1) / k^max(1, #split) * |X|``: the lower bound of the pair.

=====  ===============  =====  ====  ==================================================
pair   collective       split  hops  elements sent per rank (c_d = ceil(l_d / k))
=====  ===============  =====  ====  ==================================================
R->S   chunk (local)           0     0
R->P   partition (loc.)        0     0
S->R   all-gather       a      1     (k-1) c_a |X| / l_a
S->S   all-to-all       a b    1     (k-1) c_a c_b |X| / (l_a l_b)
S->P   all-gather       a      1     as S->R (the backward's; the forward refuses it)
P->R   all-reduce              2     2 (k-1) |X| / k
P->S   reduce-scatter   b      1     (k-1) c_b |X| / l_b
P->P   all-reduce              2     as P->R, then a partition (sum <-> avg: a local rescale)
=====  ===============  =====  ====  ==================================================

``a`` is the source's shard dim, ``b`` the target's.  The same placement or a group of one
rank is the identity.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from ..placement import Placement

__all__ = ["Move", "MOVES", "kind", "move", "split_dims", "elements", "bound_fraction"]


@dataclass(frozen=True)
class Move:
    """One transition of a mesh dim: its collective and the counts above."""

    collective: str
    split: str = ""
    """Which dims its blocks are cut on: ``a`` (the source's shard dim), ``b`` (the target's)."""
    hops: int = 0
    """Ring passes: 0 local, 1 an all-gather / all-to-all / reduce-scatter, 2 an all-reduce."""
    how: str = ""
    """Why no plan does better (the lower bound's explanation)."""
    forward: bool = True
    """Whether ``redistribute`` runs it in the forward pass (DTensor refuses S -> P there)."""


IDENTITY = Move("identity")
RESCALE = Move("rescale")
MOVES: dict[tuple[str, str], Move] = {
    ("R", "S"): Move("chunk"),
    ("R", "P"): Move("partition"),
    ("S", "R"): Move("all_gather", "a", 1, "an all-gather (the only way out of a shard)"),
    ("S", "S"): Move("all_to_all", "ab", 1, "an all-to-all (or a dearer all-gather)"),
    ("S", "P"): Move("all_gather", "a", 1, "an all-gather (the only way out of a shard) and a partition",
                     forward=False),
    ("P", "R"): Move("all_reduce", "", 2, "an all-reduce, or a reduce-scatter and later an all-gather"),
    ("P", "S"): Move("reduce_scatter", "b", 1, "a reduce-scatter (or a dearer all-reduce)"),
    ("P", "P"): Move("all_reduce", "", 2, "an all-reduce, or a reduce-scatter and later an all-gather"
                                          " (then a partition)"),
}


def kind(p: Placement) -> str:
    """The planner's kind of ``p``: ``R``, ``S`` or ``P``; raises for a placement it does not move."""
    if p.is_replicate():
        return "R"
    if p.is_shard():
        return "S"
    if p.is_partial():
        return "P"
    raise TypeError(f"the collective planner does not move {p!r} (its placement is not planned)")


def move(src: Placement, dst: Placement, k: int | None = None) -> Move:
    """The row of ``src -> dst`` on a group of ``k`` ranks (unknown: None)."""
    if src == dst or k == 1:
        return IDENTITY
    if src.rescales_to(dst):
        return RESCALE
    return MOVES[kind(src), kind(dst)]


def split_dims(m: Move, src: Placement, dst: Placement) -> list[int]:
    """The tensor dims ``m``'s blocks are cut on, for ``src -> dst``."""
    out = []
    for side, p in (("a", src), ("b", dst)):
        d = p.tensor_dim()
        if side in m.split and d is not None:
            out.append(d)
    return out


def elements(m: Move, src: Placement, dst: Placement, ell: Sequence[int], k: int) -> tuple[int, int]:
    """``(num, den)``: each rank sends ``num / den`` elements (padded pieces) of logical shape ``ell``."""
    if not m.hops:
        return 0, 1
    sizes = list(ell)
    for d in split_dims(m, src, dst):
        sizes[d] = -(-sizes[d] // k)
    n = m.hops * (k - 1)
    for s in sizes:
        n *= s
    return n, (1 if m.split else k)


def bound_fraction(m: Move, k: int) -> Fraction:
    """The share of the tensor each rank must receive for ``m`` on ``k`` ranks, unpadded."""
    return Fraction(m.hops * (k - 1), k ** max(1, len(m.split)))
