"""Explaining a move between two meshes from specs alone: who sends what to whom, and its bounds.

``explain_move`` (and ``explain_redistribute(..., dst_mesh=...)``, ``shardtensor plan --dst-mesh``)
builds the same plan the move runs (``crossmesh.cross_plan``) and reports it: the transfers per
pair of ranks, bytes each rank sends, receives and copies locally, the total against the lower
bound (every destination byte a rank lacks, received once) and the busiest sender against the
balanced optimum.  No processes or data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .crossmesh import CrossPlan, Side, cross_plan
from .spec_text import int_tuple, parse_dtype, resolve_spec

__all__ = ["MoveExplanation", "explain_move"]


@dataclass(frozen=True)
class MoveExplanation:
    """A move's plan, priced per rank.  ``str()`` is ``to_text()``."""

    plan: CrossPlan
    dtype: str

    def transfers(self) -> list[tuple[int, int, int, int]]:
        """``(sender, receiver, bytes, boxes)`` per pair of ranks, in rank order (no local copies)."""
        pairs: dict[tuple[int, int], list[int]] = {}
        for p in self.plan.pieces:
            if p.src != p.dst:
                got = pairs.setdefault((p.src, p.dst), [0, 0])
                got[0] += p.numel * self.plan.itemsize
                got[1] += 1
        return [(a, b, n, k) for (a, b), (n, k) in sorted(pairs.items())]

    def to_dict(self) -> dict:
        p = self.plan
        ranks = sorted(set(p.src.ranks) | set(p.dst.ranks))
        return {
            "shape": list(p.shape), "dtype": self.dtype, "itemsize": p.itemsize,
            "src": {"ranks": list(p.src.ranks), "mesh_shape": list(p.src.shape), "placements": [str(x) for x in p.src.placements]},
            "dst": {"ranks": list(p.dst.ranks), "mesh_shape": list(p.dst.shape), "placements": [str(x) for x in p.dst.placements]},
            "reduce_first_to": None if p.pre is None else [str(x) for x in p.pre],
            "terms_sent": p.terms if p.reduce is not None else None,
            "transfers": [{"src": a, "dst": b, "bytes": n, "boxes": k} for a, b, n, k in self.transfers()],
            "per_rank": {str(r): {"sent": p.sent(r), "received": p.received(r),
                                  "copied": sum(x.numel for x in p.pieces if x.src == r == x.dst) * p.itemsize}
                         for r in ranks},
            "total_bytes": p.total_bytes, "lower_bound": p.total_bytes,
            "busiest_sender": p.busiest_sender, "balanced_optimum": p.optimum,
        }

    def to_text(self) -> str:
        lines = [self.plan.describe(), "  transfers (sender -> receiver: bytes in boxes):"]
        lines += [f"    {a} -> {b}: {n} B in {k}" for a, b, n, k in self.transfers()] or ["    none"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()


def _side(what: str, mesh_shape: Any, ranks: Any, placements: Any, order: Any, ndim: int) -> Side:
    mesh_shape = int_tuple(f"{what} mesh shape", mesh_shape, 1)
    if not mesh_shape:
        raise ValueError(f"{what} mesh shape must have at least one dim")
    ranks = tuple(range(math.prod(mesh_shape))) if ranks is None else int_tuple(f"{what} ranks", ranks, 0)
    if len(ranks) != math.prod(mesh_shape) or len(set(ranks)) != len(ranks):
        raise ValueError(f"{what} ranks {list(ranks)} must be {math.prod(mesh_shape)} distinct non-negative ranks "
                         f"for a mesh of shape {mesh_shape}")
    pl, o = resolve_spec(what, placements, order, len(mesh_shape), ndim)
    return Side(ranks, mesh_shape, pl, o)


def explain_move(mesh_shape: Sequence[int], shape: Sequence[int], src: Any, dst_mesh_shape: Sequence[int], dst: Any,
                 *, src_ranks: Sequence[int] | None = None, dst_ranks: Sequence[int] | None = None,
                 dtype: Any = torch.float32, src_order: Any = None, dst_order: Any = None) -> MoveExplanation:
    """Plan and price moving a ``shape`` tensor from ``src`` on a ``mesh_shape`` mesh over
    ``src_ranks`` (default ``0..n-1``) to ``dst`` on a ``dst_mesh_shape`` mesh over ``dst_ranks``
    (default ``0..m-1``).  Placements as ``explain_redistribute`` takes them (``"S0,R"``)."""
    shape = int_tuple("tensor shape", shape, 0)
    dt = parse_dtype(dtype)
    a = _side("source", mesh_shape, src_ranks, src, src_order, len(shape))
    b = _side("target", dst_mesh_shape, dst_ranks, dst, dst_order, len(shape))
    return MoveExplanation(cross_plan(shape, dt.itemsize, a, b), str(dt).removeprefix("torch."))
