"""``transfer``: move a whole state dict of DTensors to another mesh in one exchange.

What an RL trainer does every step to push its weights to inference workers, or an elastic job
to move from 16 ranks to 12: every tensor's plan (``redistribute/crossmesh.py``) is laid end to
end and sent in buckets bounded in bytes, one message per pair of ranks per bucket.  Every rank of
either mesh calls it with the same arguments (ranks outside a mesh hold placeholders, as for any
DTensor on a sub-mesh); everything is checked, the same way on every rank, before anything moves.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .mesh import DeviceMesh
from .placement import Placement
from .redistribute.move import cross_target, move_locals, relocate
from .tensor import DTensor

__all__ = ["transfer"]


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
        if set(outs) != set(srcs):
            raise ValueError(f"transfer: out and src hold different names: only in src {sorted(set(srcs) - set(outs), key=str)}, "
                             f"only in out {sorted(set(outs) - set(srcs), key=str)}")
        targets = {}
        for k, x in srcs.items():
            y = outs[k]
            _check(k, x, y)
            targets[k] = y._spec
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


def _check(key: Any, x: Any, y: Any) -> None:
    """``src[key]`` can be written into ``out[key]``: both DTensors, the same shape and dtype."""
    for name, t in (("src", x), ("out", y)):
        if not isinstance(t, DTensor):
            raise TypeError(f"transfer: {name}[{key!r}] is a {type(t).__name__}, not a DTensor")
    if x.shape != y.shape:
        raise ValueError(f"transfer: {key!r} has shape {tuple(x.shape)} in src and {tuple(y.shape)} in out; "
                         "the state dicts must describe the same model")
    if x.dtype != y.dtype:
        raise ValueError(f"transfer: {key!r} is {x.dtype} in src and {y.dtype} in out; a move keeps the dtype "
                         f"(cast one side first, e.g. the source with .to({y.dtype}))")
    if y.device_mesh.device_type != x.device_mesh.device_type:
        raise ValueError(f"transfer: {key!r} is on {x.device_mesh.device_type!r} in src and "
                         f"{y.device_mesh.device_type!r} in out")
