"""``transfer``: move a whole state dict of DTensors to another mesh in one exchange.

What an RL trainer does every step to push its weights to inference workers, or an elastic job
to move from 16 ranks to 12: every tensor's plan (``redistribute/crossmesh.py``) is laid end to
end and sent in buckets bounded in bytes, one message per pair of ranks per bucket.  Every rank of
either mesh calls it with the same arguments (ranks outside a mesh hold placeholders, as for any
DTensor on a sub-mesh); everything is checked, the same way on every rank, before anything moves.
"""
from __future__ import annotations

import pickle
from typing import Any, Mapping, Sequence

import torch

from . import comm
from .mesh import DeviceMesh
from .placement import Placement, Replicate
from .redistribute.crossmesh import CrossPlan
from .redistribute.move import cross_target, move_locals, plan_move, relocate
from .spec import DTensorSpec
from .submesh import empty_local
from .tensor import DTensor

__all__ = ["transfer", "WeightSync", "lifted"]


def _named(x: Any, what: str) -> dict[Any, Any]:
    if isinstance(x, Mapping):
        return dict(x)
    if isinstance(x, (list, tuple)):
        return dict(enumerate(x))
    raise TypeError(f"transfer: {what} must be a dict of DTensors (a state dict) or a list of them, got "
                    f"{type(x).__name__}")


def _placements_for(key: Any, dst_placements: Any) -> Sequence[Placement]:
    if isinstance(dst_placements, Mapping):
        if key not in dst_placements:
            raise KeyError(f"transfer: dst_placements names no placements for {key!r}")
        return dst_placements[key]
    return dst_placements


def transfer(src: Mapping[Any, DTensor] | Sequence[DTensor], dst_mesh: DeviceMesh | None = None,
             dst_placements: Sequence[Placement] | Mapping[Any, Sequence[Placement]] | None = None, *,
             out: Mapping[Any, DTensor] | Sequence[DTensor] | None = None,
             bucket_bytes: int | None = None) -> Any:
    """Every DTensor of ``src`` moved to ``dst_mesh`` with ``dst_placements`` (one list for all, or
    a dict by name), or into the DTensors of ``out`` (their meshes and placements; their local
    tensors are overwritten in place, so an inference model's parameters take the new weights).

    Returns a container like ``src`` (``out`` itself when given).  Not differentiable: a copy of
    values, as a state dict load is.  Same-mesh entries are redistributed on their mesh.
    """
    srcs = _named(src, "src")
    if out is not None:
        outs = _named(out, "out")
        for name, sd in (("src", srcs), ("out", outs)):
            for k, t in sd.items():
                if not isinstance(t, DTensor):
                    raise TypeError(f"transfer: {name}[{k!r}] is a {type(t).__name__}, not a DTensor")
        _same_model("transfer", {k: (tuple(x.shape), x.dtype) for k, x in srcs.items()},
                   {k: (tuple(y.shape), y.dtype) for k, y in outs.items()})
        for k, x in srcs.items():
            if outs[k].device_mesh.device_type != x.device_mesh.device_type:
                raise ValueError(f"transfer: {k!r} is on {x.device_mesh.device_type!r} in src and "
                                 f"{outs[k].device_mesh.device_type!r} in out")
        targets = {k: y._spec for k, y in outs.items()}
    else:
        if dst_mesh is None or dst_placements is None:
            raise TypeError("transfer: give dst_mesh and dst_placements, or out= (DTensors to write into)")
        targets = {}
        for k, x in srcs.items():
            if not isinstance(x, DTensor):
                raise TypeError(f"transfer: src[{k!r}] is a {type(x).__name__}, not a DTensor")
            try:
                targets[k] = cross_target(x._spec, dst_mesh, _placements_for(k, dst_placements), None)
            except (ValueError, TypeError) as e:
                raise type(e)(f"transfer: {k!r}: {e}") from None
    with torch.no_grad():
        moved = [k for k in srcs if srcs[k].device_mesh != targets[k].mesh]
        locals_ = move_locals([srcs[k]._local_tensor for k in moved], [srcs[k]._spec for k in moved],
                              [targets[k] for k in moved], bucket_bytes)
        results = dict(zip(moved, locals_))
        for k in srcs:
            if k not in results:
                results[k] = relocate(srcs[k]._local_tensor, srcs[k]._spec, targets[k])
    if out is not None:
        for k, y in outs.items():
            if y.device_mesh.get_coordinate() is not None:
                with torch.no_grad():
                    y._local_tensor.copy_(results[k])
        return out
    built = {k: DTensor(results[k], targets[k], requires_grad=False) for k in srcs}
    if isinstance(src, Mapping):
        return built
    return (tuple if isinstance(src, tuple) else list)(built[i] for i in range(len(built)))


def _same_model(who: str, src: Mapping[Any, tuple[tuple[int, ...], torch.dtype]],
               out: Mapping[Any, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Two state dicts, as ``{name: (shape, dtype)}``, describe the same model: the same names,
    and per name the same shape and dtype (a move keeps both); else a ``ValueError`` naming them."""
    if set(src) != set(out):
        raise ValueError(f"{who}: out and src hold different names: only in src {sorted(set(src) - set(out), key=str)}, "
                         f"only in out {sorted(set(out) - set(src), key=str)}")
    for k in sorted(src, key=str):
        (s_shape, s_dtype), (d_shape, d_dtype) = src[k], out[k]
        if s_shape != d_shape:
            raise ValueError(f"{who}: {k!r} has shape {s_shape} in src and {d_shape} in out; "
                             "the state dicts must describe the same model")
        if s_dtype != d_dtype:
            raise ValueError(f"{who}: {k!r} is {s_dtype} in src and {d_dtype} in out; a move keeps the dtype "
                             f"(cast one side first, e.g. the source with .to({d_dtype}))")


def lifted(spec: DTensorSpec, mesh: DeviceMesh, what: str) -> DTensorSpec:
    """``spec`` seen on ``mesh``: itself, or, for a DTensor on a sub-mesh of ``mesh``
    (``mesh["dp"]``), the spec on ``mesh`` that is Replicate on the other mesh dims (the 2-D
    recipe's non-TP parameters: each tp rank holds the same dp-sharded values)."""
    if spec.mesh == mesh:
        return spec
    root = spec.mesh._root
    if root is None or root != mesh:
        raise ValueError(f"{what} lives on mesh {spec.mesh.mesh.tolist()}, neither the mesh "
                         f"{mesh.mesh.tolist()} nor one of its sub-meshes")
    dims = spec.mesh._root_dims
    pl: list[Placement] = [Replicate()] * mesh.ndim
    for i, j in enumerate(dims):
        pl[j] = spec.placements[i]
    order = tuple((d, tuple(dims[j] for j in js)) for d, js in spec.shard_order)
    return DTensorSpec.build(mesh, pl, spec.shape, spec.stride, spec.dtype, order)


Layout = dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, tuple[Placement, ...], Any]]


class WeightSync:
    """Push a state dict from one mesh to another, every step, when each side knows only its own.

    An RL trainer (ranks 0-3) and inference workers (ranks 4-7) run different code: both build
    ``WeightSync(trainer_mesh, inference_mesh)`` and call it after every step, the trainer's ranks
    with ``src=`` their state dict, the inference ranks with ``out=`` theirs (a rank in both passes
    both).  On the first call the first rank of each side sends its side's layout (names, shapes,
    dtypes, placements) to the ranks of the other side; every rank checks that the two agree and
    raises the same error if not, before any weight moves.  Later calls reuse the plan.

    DTensors on a sub-mesh (``mesh["dp"]`` or ``mesh["tp"]``) are taken as replicated over the
    mesh's other dims: a trainer's non-TP parameters, an inference engine's TP replicas.
    """

    def __init__(self, src_mesh: DeviceMesh, dst_mesh: DeviceMesh, *, bucket_bytes: int | None = None) -> None:
        for name, m in (("src_mesh", src_mesh), ("dst_mesh", dst_mesh)):
            if not isinstance(m, DeviceMesh):
                raise TypeError(f"WeightSync: {name} must be a DeviceMesh, got {m!r}")
        if src_mesh.device_type != dst_mesh.device_type:
            raise ValueError(f"WeightSync: src_mesh is on {src_mesh.device_type!r}, dst_mesh on "
                             f"{dst_mesh.device_type!r}")
        self.src_mesh, self.dst_mesh, self.bucket_bytes = src_mesh, dst_mesh, bucket_bytes
        self._layouts: tuple[Layout, Layout] | None = None
        self._specs: tuple[dict[str, DTensorSpec], dict[str, DTensorSpec]] | None = None

    def __call__(self, src: Mapping[str, DTensor] | None = None,
                 out: Mapping[str, DTensor] | None = None) -> Mapping[str, DTensor] | None:
        """Move ``src`` (this rank's, if it is in the source mesh) into ``out`` (if in the destination)."""
        in_src = self.src_mesh.get_coordinate() is not None
        in_dst = self.dst_mesh.get_coordinate() is not None
        if not (in_src or in_dst):
            return out
        for flag, arg, name, side in ((in_src, src, "src", "source"), (in_dst, out, "out", "destination")):
            if flag and not isinstance(arg, Mapping):
                raise TypeError(f"WeightSync: this rank is in the {side} mesh: pass {name}= (a state dict of "
                                f"DTensors), got {type(arg).__name__}")
        mine = (self._layout(src, self.src_mesh, "src") if in_src else None,
                self._layout(out, self.dst_mesh, "out") if in_dst else None)
        if self._layouts is None:
            self._layouts = self._share(*mine)
            self._specs = (_specs(self._layouts[0], self.src_mesh), _specs(self._layouts[1], self.dst_mesh))
        for got, first, name in zip(mine, self._layouts, ("src", "out")):
            if got is not None and got != first:
                raise ValueError(f"WeightSync: {name} changed layout since the first call; build a new WeightSync")
        assert self._specs is not None  # set with the layouts
        src_specs, dst_specs = self._specs
        names = sorted(src_specs)
        device = torch.device(self.src_mesh.device_type)
        locs = [src[k]._local_tensor if in_src and src is not None else empty_local(src_specs[k], device)
                for k in names]
        with torch.no_grad():
            moved = move_locals(locs, [src_specs[k] for k in names], [dst_specs[k] for k in names], self.bucket_bytes)
            if in_dst and out is not None:
                for k, t in zip(names, moved):
                    out[k]._local_tensor.copy_(t)
        return out

    def plans(self) -> dict[str, CrossPlan]:
        """Every tensor's plan (after the first call): its transfers, bytes and bounds (``describe()``)."""
        if self._specs is None:
            raise RuntimeError("WeightSync.plans(): call the sync once first (the layouts travel then)")
        src, dst = self._specs
        return {k: plan_move(src[k], dst[k]) for k in sorted(src)}

    @staticmethod
    def _layout(sd: Any, mesh: DeviceMesh, name: str) -> Layout:
        out: Layout = {}
        for k, v in sd.items():
            if not isinstance(v, DTensor):
                raise TypeError(f"WeightSync: {name}[{k!r}] is a {type(v).__name__}, not a DTensor")
            out[str(k)] = _entry(lifted(v._spec, mesh, f"WeightSync: {name}[{k!r}]"))
        return out

    def _share(self, src: Layout | None, dst: Layout | None) -> tuple[Layout, Layout]:
        """Both layouts on every rank of either mesh, checked to agree: each side's first rank sends
        its own to the other side's ranks outside its mesh (two point-to-point rounds: sizes, then bytes)."""
        me = comm.current_transport().rank
        a, b = self.src_mesh._all, self.dst_mesh._all
        plan = [(a[0], [r for r in b if r not in a], src), (b[0], [r for r in a if r not in b], dst)]
        got: list[Any] = [src, dst]
        dev = torch.device(self.src_mesh.device_type)  # NCCL moves device tensors only
        blobs = [pickle.dumps(lay) if lay is not None and me == first else b"" for first, _, lay in plan]
        sizes = [torch.tensor([len(x)], dtype=torch.int64, device=dev) for x in blobs]
        for round_ in ("size", "bytes"):
            sends, recvs, slots = [], [], []
            for i, (first, to, _) in enumerate(plan):
                if me == first:
                    data = sizes[i] if round_ == "size" else torch.frombuffer(bytearray(blobs[i]), dtype=torch.uint8).to(dev)
                    sends += [(r, data) for r in to]
                elif me in to:
                    buf = torch.empty(1 if round_ == "size" else int(sizes[i][0]),
                                      dtype=torch.int64 if round_ == "size" else torch.uint8, device=dev)
                    recvs.append((first, buf))
                    slots.append((i, buf))
            comm.send_recv(sends, recvs)
            for i, buf in slots:
                if round_ == "size":
                    sizes[i] = buf
                else:
                    got[i] = pickle.loads(buf.cpu().numpy().tobytes())
        src_layout, dst_layout = got
        _same_model("WeightSync", {k: (e[0], e[2]) for k, e in src_layout.items()},
                    {k: (e[0], e[2]) for k, e in dst_layout.items()})
        return src_layout, dst_layout


def _entry(spec: DTensorSpec) -> tuple:
    return (tuple(spec.shape), tuple(spec.stride), spec.dtype, tuple(spec.placements), spec.shard_order)


def _specs(layout: Layout, mesh: DeviceMesh) -> dict[str, DTensorSpec]:
    return {k: DTensorSpec.build(mesh, pl, shape, stride, dtype, order)
            for k, (shape, stride, dtype, pl, order) in layout.items()}
