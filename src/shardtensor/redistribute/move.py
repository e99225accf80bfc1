"""Running point-to-point plans: many tensors, one bucketed exchange.

``relocate`` is what ``DTensor.redistribute`` runs: on one mesh ``redistribute_local`` (the
collective plan of ``execute.py`` where the planner moves every placement of both specs, else
the exchange of blocks of ``crossmesh.py``), between two meshes the point-to-point plan.  A move of
several tensors (``move_locals``, behind ``shardtensor.transfer``) lays every tensor's pieces
end to end in plan order and cuts that list into buckets of at most ``bucket_bytes``: per
bucket, each pair of ranks exchanges one message (the pieces' bytes packed, widest dtype
first so every piece stays aligned), so a rank's extra memory is bounded by the bucket size,
and every receiver copies each piece straight into its destination local tensor.
"""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Sequence

import torch

from .. import comm
from ..comm.base import avg_divide
from ..mesh import DeviceMesh
from ..spec import DTensorSpec, same_local
from ..submesh import empty_local
from .crossmesh import CrossPlan, Piece, Side, cross_plan
from .execute import laid_out, reduce_partials, run_plan

__all__ = ["redistribute_local", "relocate", "move_locals", "plan_move", "cross_target", "BUCKET_BYTES"]

BUCKET_BYTES = int(os.environ.get("SHARDTENSOR_MOVE_BUCKET_BYTES", str(64 << 20)))
"""The most bytes one bucket of a move carries over all ranks (each rank's extra memory is at most this)."""


def side(spec: DTensorSpec) -> Side:
    return Side(spec.mesh._all, tuple(spec.mesh.shape), tuple(spec.placements), spec.shard_order)


@lru_cache(maxsize=4096)
def plan_move(src: DTensorSpec, dst: DTensorSpec) -> CrossPlan:
    """The cached plan moving a tensor of spec ``src`` to spec ``dst`` (another mesh)."""
    return cross_plan(tuple(src.shape), max(src.dtype.itemsize, 1), side(src), side(dst))


def cross_target(src: DTensorSpec, mesh: object, placements: Sequence, shard_order: object) -> DTensorSpec:
    """The spec a move to ``mesh`` ends with, checked before anything moves (the same error on every rank)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"redistribute: device_mesh must be a DeviceMesh, got {mesh!r}")
    if mesh.device_type != src.mesh.device_type:
        raise ValueError(f"redistribute: the destination mesh is on {mesh.device_type!r} and the source on "
                         f"{src.mesh.device_type!r}; move between meshes of one device type")
    world = comm.current_transport().world_size
    if int(mesh.mesh.max()) >= world:
        raise ValueError(f"redistribute: the destination mesh {mesh.mesh.tolist()} names ranks outside this world "
                         f"of {world} ranks")
    return DTensorSpec.build(mesh, placements, src.shape, src.stride, src.dtype, shard_order)  # type: ignore[arg-type]


def relocate(t: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, async_op: bool = False) -> torch.Tensor:
    """This rank's local tensor of ``dst`` from its local tensor of ``src`` (same mesh or not)."""
    if src.mesh == dst.mesh:
        return redistribute_local(t, src, dst, async_op)
    return move_locals([t], [src], [dst])[0]


def redistribute_local(t: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, async_op: bool = False) -> torch.Tensor:
    """This rank's local tensor of ``dst`` from its local tensor of ``src`` (one mesh): the
    planner's collectives where it moves every placement of both (``execute.py``), else one
    exchange of blocks in which each rank receives exactly what it lacks (``crossmesh.py``), after
    all-reduces of the source's Partial mesh dims where the exchange's price says so."""
    if src.mesh != dst.mesh:
        raise NotImplementedError(f"cross-mesh redistribution is not supported: {src.mesh} -> {dst.mesh}")
    if src.mesh.get_coordinate() is None:
        return t
    if src.placements == dst.placements and src.shard_order == dst.shard_order:
        return t
    if t.shape == src.shape and same_local(src, dst.with_dtype(src.dtype)):
        return t  # they differ only on mesh dims of one rank
    if src.planned and dst.planned:
        return run_plan(t, src, dst, async_op)
    if src.shard_order == dst.shard_order and all(
            a == b or (a.is_partial() and b.is_replicate()) for a, b in zip(src.placements, dst.placements)):
        return reduce_partials(t, src, dst)
    return move_locals([t], [src], [dst])[0]


def _slices(at: tuple[int, ...], size: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(at, size))


def _start(dst: DTensorSpec, plan: CrossPlan, me: int, like: torch.Tensor) -> torch.Tensor:
    """The destination local tensor before any piece lands: empty, or the identity it keeps."""
    if dst.mesh.get_coordinate() is None:
        return empty_local(dst, like.device)
    shape = dst.local_shape_and_offset()[0]
    fill = dict(plan.fill).get(me)
    if fill is None:
        return torch.empty(shape, dtype=dst.dtype, device=like.device)
    return (torch.zeros if fill == "sum" else torch.ones)(shape, dtype=dst.dtype, device=like.device)


def _bounded(p: Piece, most: int) -> list[Piece]:
    """``p`` cut in row-major runs of at most ``most`` elements (a piece larger than a bucket)."""
    out: list[Piece] = []
    rest = [p]
    while rest:
        head, tail = rest.pop(0).split(most)
        out += head
        rest = tail + rest
    return out


def move_locals(ts: Sequence[torch.Tensor], srcs: Sequence[DTensorSpec], dsts: Sequence[DTensorSpec],
                bucket_bytes: int | None = None) -> list[torch.Tensor]:
    """Move each local tensor ``ts[i]`` from spec ``srcs[i]`` to ``dsts[i]`` (other meshes) in one
    exchange.  Every rank of either mesh calls this with the same specs."""
    me = comm.current_transport().rank
    limit = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    plans = [plan_move(s, d) for s, d in zip(srcs, dsts)]
    held = []
    for t, s, p in zip(ts, srcs, plans):
        if p.pre is not None and s.mesh.get_coordinate() is not None:
            t = redistribute_local(t, s, s.with_placements(p.pre, p.pre_order))
        held.append(t)
    outs = [_start(d, p, me, t) for d, p, t in zip(dsts, plans, ts)]
    bucket: list[tuple[int, Piece]] = []
    size = 0
    for i, p in enumerate(plans):
        for pc in p.pieces:
            if pc.src == pc.dst:  # a local copy, in its place in the order (terms combine in order)
                if pc.src == me:
                    bucket.append((i, pc))
                continue
            for q in _bounded(pc, max(limit // p.itemsize, 1)):
                n = q.numel * p.itemsize
                if size and size + n > limit:
                    _exchange(bucket, held, outs, plans, me)
                    bucket, size = [], 0
                bucket.append((i, q))
                size += n
    _exchange(bucket, held, outs, plans, me)
    for o, d, p in zip(outs, dsts, plans):
        if p.reduce == "avg" and d.mesh.get_coordinate() is not None and me not in dict(p.fill):
            o.copy_(avg_divide(o, p.terms))
    return [laid_out(o, d.stride) if d.mesh.get_coordinate() is not None else o for o, d in zip(outs, dsts)]


def _exchange(bucket: list[tuple[int, Piece]], held: list[torch.Tensor], outs: list[torch.Tensor],
              plans: list[CrossPlan], me: int) -> None:
    """One bucket: a packed message per peer each way, then every piece this rank gets (received
    or its own) written into place in plan order."""
    out_to: dict[int, list[tuple[int, Piece]]] = {}
    in_from: dict[int, list[tuple[int, Piece]]] = {}
    for i, pc in bucket:
        if pc.src == me and pc.dst != me:
            out_to.setdefault(pc.dst, []).append((i, pc))
        elif pc.dst == me and pc.src != me:
            in_from.setdefault(pc.src, []).append((i, pc))
    width = [t.element_size() for t in outs]
    sends = []
    for peer, items in out_to.items():
        items.sort(key=lambda x: -width[x[0]])  # widest first: every piece starts aligned for its dtype
        parts = [held[i][_slices(pc.src_at, pc.size)].contiguous().reshape(-1).view(torch.uint8) for i, pc in items]
        sends.append((peer, torch.cat(parts)))
    recvs = []
    for peer, items in in_from.items():
        items.sort(key=lambda x: -width[x[0]])
        nbytes = sum(pc.numel * width[i] for i, pc in items)
        recvs.append((peer, torch.empty(nbytes, dtype=torch.uint8, device=outs[items[0][0]].device)))
    with comm.scope("move"):
        comm.send_recv(sends, recvs)
    got: dict[tuple[int, Piece], torch.Tensor] = {}
    for (peer, buf), items in zip(recvs, in_from.values()):
        pos = 0
        for i, pc in items:
            n = pc.numel * width[i]
            got[(i, pc)] = buf[pos:pos + n].view(outs[i].dtype).view(pc.size)
            pos += n
    for i, pc in bucket:
        if pc.dst == me:
            part = got[(i, pc)] if pc.src != me else held[i][_slices(pc.src_at, pc.size)]
            _write(outs[i][_slices(pc.dst_at, pc.size)], part, plans[i].reduce if pc.term > 0 else None)


def _write(into: torch.Tensor, part: torch.Tensor, op: str | None) -> None:
    """Write a piece into place, or combine a Partial source's later term with what is there."""
    if op is None:
        into.copy_(part)
    elif op in ("sum", "avg"):
        into.add_(part)
    elif op == "product":
        into.mul_(part)
    else:
        into.copy_(torch.maximum(into, part) if op == "max" else torch.minimum(into, part))
