"""Runs a plan on this rank's local tensor: one single-mesh-dim transition per step.

Each step works on the step's logical shape (the tensor the mesh dim's group sees: the
global shape with every other sharding of the state applied).  Uneven pieces are padded to
the chunk size before a collective and trimmed after, so every collective moves equal blocks.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from .. import comm
from ..async_tensor import AsyncLocalTensor
from ..comm.base import Completed, Work
from ..mesh import DeviceMesh
from ..placement import Partial, Placement, Replicate, chunk, local_shape_and_offset, partial_op
from .exchange import blocks
from .moves import IDENTITY, kind, move
from .planner import plan_for
from .steps import ExchangeStep, FlatStep, Step

Shape = Sequence[int]


def _coord(mesh: DeviceMesh) -> list[int]:
    """This rank's coordinate (the executor only runs on ranks of the mesh)."""
    coord = mesh.get_coordinate()
    assert coord is not None, "redistribution on a rank outside the mesh"
    return coord


def _pad_to(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    extra = length - t.shape[dim]
    if extra == 0:
        return t
    pad = [0, 0] * (t.ndim - 1 - dim) + [0, extra]
    return F.pad(t, pad)


def _pieces(t: torch.Tensor, dim: int, k: int) -> torch.Tensor:
    """Split ``t`` along ``dim`` by the chunk rule, pad each piece: a ``(k, ...)`` stack."""
    length = t.shape[dim]
    c = -(-length // k) if length else 0
    t = _pad_to(t, dim, k * c)
    shape = list(t.shape)
    shape[dim:dim + 1] = [k, c]
    return t.reshape(shape).movedim(dim, 0)


def _merge(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """``(k, ..., c at dim, ...)`` -> ``(..., k*c at dim, ...)``: blocks in order along ``dim``.

    A view when ``dim`` is 0 (no copy of the gathered buffer), one copy otherwise.
    """
    shape = list(stacked.shape[1:])
    shape[dim] *= stacked.shape[0]
    return stacked.movedim(0, dim).reshape(shape)


def _logical_len(step: Step, global_shape, mesh: DeviceMesh, coord, dim: int) -> int:
    """Length of tensor dim ``dim`` that the step's group sees (its own splits undone)."""
    own = step.mesh_dims
    pl = [Replicate() if j in own else p for j, p in enumerate(step.placements)]
    order = tuple((d, tuple(m for m in js if m not in own)) for d, js in step.order)
    order = tuple((d, js) for d, js in order if js)
    return local_shape_and_offset(global_shape, mesh.shape, coord, pl, order)[0][dim]


def _dim(p: Placement) -> int:
    """The tensor dim of a shard in a step (the move's row says the step has one)."""
    d = p.tensor_dim()
    assert d is not None, p
    return d


def _op(p: Placement) -> str:
    """The reduction of a partial in a step."""
    op = partial_op(p)
    assert op is not None, p
    return op


def _nested_pieces(length: int, ks: list[int]) -> list[tuple[int, int]]:
    """``(size, offset)`` of every piece when ``length`` is split by ``ks`` in turn (row-major)."""
    pieces = [(length, 0)]
    for k in ks:
        pieces = [(s, o + off) for size, o in pieces for s, off in (chunk(size, k, i) for i in range(k))]
    return pieces


def _apply_exchange(t: torch.Tensor, step: ExchangeStep, global_shape, mesh: DeviceMesh, a: bool = False):
    """The whole change of ``step.dims`` in one all-to-all of unpadded blocks (``exchange.py``)."""
    coord = tuple(_coord(mesh))
    send, recv = blocks(tuple(global_shape), tuple(mesh.shape), coord, step.dims, step.placements, step.order,
                        step.target, step.target_order)
    _, held = local_shape_and_offset(global_shape, mesh.shape, coord, step.placements, step.order)
    size, need = local_shape_and_offset(global_shape, mesh.shape, coord, step.target, step.target_order)

    def cut(x: torch.Tensor, box, base) -> torch.Tensor:
        for d, (o, n, b) in enumerate(zip(box[0], box[1], base)):
            if n != x.shape[d]:
                x = x.narrow(d, o - b, n)
        return x

    empty = (0,) * t.ndim
    sends = [t.new_empty(empty) if b is None else cut(t, b, held).contiguous() for b in send]
    shapes = [empty if b is None else b[1] for b in recv]

    def assemble(got: list) -> torch.Tensor:
        out = t.new_empty(size)
        for b, g in zip(recv, got):
            if b is not None:
                cut(out, b, need).copy_(g)
        return out

    return _then(comm.all_to_all_v(sends, shapes, mesh, step.dims, a), assemble, a)


def _apply_flat(t: torch.Tensor, step: FlatStep, global_shape, mesh: DeviceMesh, a: bool = False):
    """One collective over the flattened group of ``step.dims`` (major first)."""
    src, dst, dims = step.src, step.dst, step.dims
    coord = _coord(mesh)
    ks = [mesh.shape[j] for j in dims]
    me = 0
    for j, k in zip(dims, ks):
        me = me * k + coord[j]
    run = _FLAT.get((kind(src), kind(dst)))
    if run is None:
        raise NotImplementedError(f"no flattened transition from {src} to {dst} over mesh dims {dims}")
    return run(t, step, global_shape, mesh, coord, ks, me, a)


def _flat_reduce(t: torch.Tensor, step: FlatStep, global_shape: Shape, mesh: DeviceMesh, coord: list[int], ks: list[int],
        me: int, a: bool) -> Any:
    t, back = _norm_pre(t, step.src)
    return _then(comm.all_reduce(t, _op(step.src), mesh, step.dims, a), back, a)


def _flat_gather(t: torch.Tensor, step: FlatStep, global_shape: Shape, mesh: DeviceMesh, coord: list[int], ks: list[int],
        me: int, a: bool) -> Any:
    d = _dim(step.src)
    pieces = _nested_pieces(_logical_len(step, global_shape, mesh, coord, d), ks)
    c = pieces[0][0]
    gathered = comm.all_gather(_pad_to(t, d, c).contiguous(), mesh, step.dims, a)
    if all(size == c for size, _ in pieces):
        return _then(gathered, lambda g: _merge(g, d), a)
    return _then(gathered, lambda g: torch.cat([g[i].narrow(d, 0, n) for i, (n, _) in enumerate(pieces)], d), a)


def _flat_reduce_scatter(t: torch.Tensor, step: FlatStep, global_shape: Shape, mesh: DeviceMesh, coord: list[int], ks: list[int],
        me: int, a: bool) -> Any:
    d = _dim(step.dst)
    pieces = _nested_pieces(t.shape[d], ks)
    c = pieces[0][0]
    t, back = _norm_pre(t, step.src)
    if all(size == c for size, _ in pieces):
        stack = _pieces(t, d, len(pieces))
    else:
        stack = torch.stack([_pad_to(t.narrow(d, off, size), d, c) for size, off in pieces])
    out = comm.reduce_scatter(stack.contiguous(), _op(step.src), mesh, step.dims, a)
    return _then(out, lambda o: back(o.narrow(d, 0, pieces[me][0])), a)


_FLAT = {("P", "R"): _flat_reduce, ("S", "R"): _flat_gather, ("P", "S"): _flat_reduce_scatter}


def apply_step(t: torch.Tensor, step: Step, global_shape, mesh: DeviceMesh,
               async_op: bool = False) -> "torch.Tensor | Work":
    """One transition (docs/redistribution.md) on the local tensor ``t``.

    With ``async_op`` the collective is issued and a ``Work`` returned whose ``wait()`` gives
    the result (a local step gives a ``Completed`` one).
    """
    out = _apply(t, step, global_shape, mesh, async_op)
    return Completed(out) if async_op and not isinstance(out, Work) else out


def _then(x, fn, a: bool):
    """``fn`` on a collective's result: now, or at the wait of its ``Work``."""
    return x.then(fn) if a else fn(x)


def _apply(t: torch.Tensor, step: Step, global_shape, mesh: DeviceMesh, a: bool):
    if type(step) is FlatStep:
        return _apply_flat(t, step, global_shape, mesh, a)
    if type(step) is ExchangeStep:
        return _apply_exchange(t, step, global_shape, mesh, a)
    src, dst, j = step.src, step.dst, step.mesh_dim
    k = mesh.shape[j]
    m = move(src, dst, k)
    if m is IDENTITY:
        return t
    if not m.forward:
        raise RuntimeError(f"redistributing {src} to {dst} is not supported in the forward pass")
    coord = _coord(mesh)
    run = _RUN.get(m.collective)
    if run is None:
        raise NotImplementedError(f"no transition from {src} to {dst} on mesh dim {j}")
    return run(t, step, global_shape, mesh, coord, k, coord[j], a)


def _chunk(t: torch.Tensor, step: Step, global_shape: Shape, mesh: DeviceMesh, coord: list[int], k: int, me: int,
        a: bool) -> Any:
    d = _dim(step.dst)
    size, off = chunk(t.shape[d], k, me)
    return t.narrow(d, off, size).clone()


def _partition(t: torch.Tensor, step: Step, global_shape: Shape, mesh: DeviceMesh, coord: list[int], k: int, me: int,
        a: bool) -> Any:
    return step.dst.split_value(t, k, me)


def _gather(t: torch.Tensor, step: Step, global_shape: Shape, mesh: DeviceMesh, coord: list[int], k: int, me: int,
        a: bool) -> Any:
    d = _dim(step.src)
    length = _logical_len(step, global_shape, mesh, coord, d)
    c = -(-length // k) if length else 0
    gathered = comm.all_gather(_pad_to(t, d, c).contiguous(), mesh, step.mesh_dim, a)
    return _then(gathered, lambda g: _merge(g, d).narrow(d, 0, length), a)


def _reduce(t: torch.Tensor, step: Step, global_shape: Shape, mesh: DeviceMesh, coord: list[int], k: int, me: int,
        a: bool) -> Any:
    """P -> R; P -> another P (planned as P -> R then R -> P) all-reduces, then partitions."""
    src, dst = step.src, step.dst
    t, back = _norm_pre(t, src)
    out = _then(comm.all_reduce(t, _op(src), mesh, step.mesh_dim, a), back, a)
    return out if dst.is_replicate() else _then(out, lambda x: dst.split_value(x, k, me), a)


def _reduce_scatter(t: torch.Tensor, step: Step, global_shape: Shape, mesh: DeviceMesh, coord: list[int], k: int, me: int,
        a: bool) -> Any:
    d = _dim(step.dst)
    size, _ = chunk(t.shape[d], k, me)
    t, back = _norm_pre(t, step.src)
    out = comm.reduce_scatter(_pieces(t, d, k).contiguous(), _op(step.src), mesh, step.mesh_dim, a)
    return _then(out, lambda o: back(o.narrow(d, 0, size)), a)


def _all_to_all(t: torch.Tensor, step: Step, global_shape: Shape, mesh: DeviceMesh, coord: list[int], k: int, me: int,
        a: bool) -> Any:
    ad, bd = _dim(step.src), _dim(step.dst)
    la = _logical_len(step, global_shape, mesh, coord, ad)
    ca = -(-la // k) if la else 0
    size_b, _ = chunk(t.shape[bd], k, me)
    blocks = _pieces(_pad_to(t, ad, ca), bd, k).contiguous()
    recv = comm.all_to_all(blocks, mesh, step.mesh_dim, a)
    return _then(recv, lambda r: _merge(r, ad).narrow(ad, 0, la).narrow(bd, 0, size_b), a)


def _rescale(t: torch.Tensor, step: Step, global_shape: Shape, mesh: DeviceMesh, coord: list[int], k: int, me: int,
        a: bool) -> Any:
    """Partial sum <-> avg, locally (an integer average's terms: see below)."""
    if _op(step.src) == "sum":
        return t * k
    if t.is_floating_point() or t.is_complex():
        return t / k
    # integer terms: a floor per term would not add up to the floor of the mean
    return Partial("sum").split_value(comm.all_reduce(t, "avg", mesh, step.mesh_dim), k, me)


_RUN = {"chunk": _chunk, "partition": _partition, "all_gather": _gather, "all_reduce": _reduce,
        "reduce_scatter": _reduce_scatter, "all_to_all": _all_to_all, "rescale": _rescale}


def _norm_pre(t: torch.Tensor, src: Placement):
    """For ``PN(p)`` with finite ``p`` other than 0 and 1: ``L^p`` in fp32 before the sum, ``^(1/p)`` after."""
    p = getattr(src, "norm", None)
    if p is None or p in (0.0, 1.0) or p in (float("inf"), float("-inf")):
        return t, lambda x: x
    dtype = t.dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return t.to(wide).pow(p), lambda x: x.pow(1.0 / p).to(dtype)


def run_plan(t: torch.Tensor, src_spec, dst_spec, async_op: bool = False) -> torch.Tensor:
    """Move this rank's local tensor from ``src_spec`` to ``dst_spec`` (same mesh, this rank on it,
    different layouts: ``move.redistribute_local`` checks) by the planner's collectives (every
    placement of both is one the planner moves).

    ``async_op``: the last collective is left in flight and an ``AsyncLocalTensor`` returned
    (its shape is known; the first op on it waits).  Earlier steps feed the last one, so they
    complete before this returns.
    """
    mesh = src_spec.mesh
    for j, (a, b) in enumerate(zip(src_spec.placements, dst_spec.placements)):
        if not move(a, b, mesh.shape[j]).forward:
            raise RuntimeError(f"redistributing {a} to {b} on mesh dim {j} is not supported in the forward pass")
    steps = plan_for(src_spec, dst_spec)
    if async_op and steps:
        for step in steps[:-1]:
            t = _apply(t, step, src_spec.shape, mesh, False)
        work = apply_step(t, steps[-1], src_spec.shape, mesh, async_op=True)
        if type(work) is Completed:
            return laid_out(work.wait(), dst_spec.stride)
        assert isinstance(work, Work)
        work = work.chain(lambda x: laid_out(x, dst_spec.stride))
        return AsyncLocalTensor(work, dst_spec.local_shape_and_offset()[0], t.dtype, t.device)
    for step in steps:
        t = _apply(t, step, src_spec.shape, mesh, False)
    return laid_out(t, dst_spec.stride)


def reduce_partials(t: torch.Tensor, src_spec, dst_spec) -> torch.Tensor:
    """``dst_spec`` is ``src_spec`` with Partial mesh dims made Replicate: an all-reduce on each
    (the other placements, whatever they are, stay as they are on every rank of its group)."""
    for j, (a, b) in enumerate(zip(src_spec.placements, dst_spec.placements)):
        if a != b:
            t = _apply(t, Step(j, a, b, src_spec.placements, src_spec.shard_order), src_spec.shape, src_spec.mesh, False)
    return laid_out(t, dst_spec.stride)


def laid_out(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``t`` with its dims in memory in the order of the global ``stride`` (outermost first).

    A gather leaves its result in whatever layout was cheapest (a transposed view when each rank
    held one column, a strided narrow of uneven pieces), but kernels such as ``linalg_det`` pick
    their algorithm by the layout of the local tensor while the backward reads the layout of the
    DTensor: the two must agree, or the gradient is silently wrong.  One copy where they differ.
    """
    if t.is_contiguous() and all(a >= b for a, b in zip(stride, stride[1:])):
        return t
    if any(s == 0 and n > 1 for s, n in zip(stride, t.shape)):
        return t  # an expanded global tensor: no order to follow
    perm = sorted(range(t.ndim), key=lambda d: (-stride[d], d))
    moved = t.permute(perm)
    if moved.is_contiguous():
        return t
    inverse = sorted(range(t.ndim), key=lambda d: perm[d])
    return moved.contiguous().permute(inverse)
