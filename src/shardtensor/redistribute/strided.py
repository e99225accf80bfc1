"""StridedShard on the wire: a packed layout goes through its replica on its own mesh dim.

A ``StridedShard`` mesh dim is unpacked (one all-gather of the unequal pieces, reordered group by
group) before the plan between ordinary placements runs, and packed after it (a local slice of
each group).  The planner never sees a StridedShard, so no cost model or transition learns it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm
from ..placement import Replicate, StridedShard, local_shape_and_offset, strided_runs


def _strided(spec) -> list[tuple[int, StridedShard]]:
    return [(j, p) for j, p in enumerate(spec.placements) if type(p) is StridedShard]


def plain(spec):
    """``spec`` with every StridedShard mesh dim replicated (the planner's view of it)."""
    pl = [Replicate() if type(p) is StridedShard else p for p in spec.placements]
    return spec.with_placements(pl, spec.shard_order)


def unpack(t: torch.Tensor, spec) -> torch.Tensor:
    """This rank's local tensor under ``plain(spec)``: each StridedShard mesh dim gathered."""
    mesh = spec.mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return t
    pl = list(spec.placements)
    for j, p in _strided(spec):
        pl[j] = Replicate()
        d, k = p.dim, mesh.shape[j]
        length = local_shape_and_offset(spec.shape, mesh.shape, coord, pl, spec.shard_order)[0][d]
        runs = [strided_runs(length, p.split_factor, k, r) for r in range(k)]
        most = max(sum(s for s, _ in rr) for rr in runs)
        pad = [0, 0] * (t.ndim - 1 - d) + [0, most - t.shape[d]]
        gathered = comm.all_gather(F.pad(t, pad).contiguous(), mesh, j)
        pieces = [gathered[r].split([s for s, _ in rr] + [most - sum(s for s, _ in rr)], dim=d)
                  for r, rr in enumerate(runs)]
        t = torch.cat([pieces[r][g] for g in range(p.split_factor) for r in range(k)], dim=d)
    return t


def pack(t: torch.Tensor, spec) -> torch.Tensor:
    """From this rank's local tensor under ``plain(spec)`` to the one under ``spec`` (no comm)."""
    coord = spec.mesh.get_coordinate()
    if coord is None:
        return t
    for j, p in _strided(spec):
        runs = strided_runs(t.shape[p.dim], p.split_factor, spec.mesh.shape[j], coord[j])
        t = torch.cat([t.narrow(p.dim, o, s) for s, o in runs], dim=p.dim)
    return t
