"""List ops (``_foreach_*``, ``_fused_*``) over DTensors of several meshes: one call per mesh.

After torch's 2-D recipe the TP weights live on the 2-D mesh and the norm weights on
``mesh["dp"]``; an optimizer step or ``_foreach_norm`` takes them all in one list.  The list is
split by the mesh of each element of the first list, the op runs once per mesh (in the order the
meshes first appear, the same on every rank), and the results are put back in list order, each
output on its own input's mesh.  A single tensor argument on another mesh (a learning rate or a
clip coefficient) is taken as-is when it is replicated over a mesh covering the group's ranks.
"""
from __future__ import annotations

from typing import Any, Callable

from .mesh import DeviceMesh
from .placement import Replicate
from .propagation import MeshMismatchError
from .spec import DTensorSpec

__all__ = ["is_list_op", "run_per_mesh"]


def is_list_op(func: Any) -> bool:
    args = func._schema.arguments
    name = func._schema.name.split("::")[-1]
    return bool(args) and str(args[0].type) == "List[Tensor]" and name.startswith(("_foreach_", "_fused_"))


def _mesh_of(t: Any) -> DeviceMesh | None:
    spec = getattr(t, "_spec", None)
    return spec.mesh if isinstance(spec, DTensorSpec) else None


def _onto(t: Any, mesh: DeviceMesh, func: Any, wrap: Callable) -> Any:
    """A single tensor argument moved onto ``mesh`` where its value is already there on every rank."""
    m = _mesh_of(t)
    if m is None or m == mesh:
        return t
    covers = set(mesh.mesh.flatten().tolist()) <= set(m.mesh.flatten().tolist())
    if not covers or not all(isinstance(p, Replicate) for p in t._spec.placements):
        raise MeshMismatchError(f"{func}: argument on {m!r} with placements {t._spec.placements} cannot join "
                                f"tensors on {mesh!r}; make it Replicate on a mesh covering those ranks")
    spec = DTensorSpec.build(mesh, [Replicate()] * mesh.ndim, t._spec.shape, t._spec.stride, t._spec.dtype)
    return wrap(t._local_tensor, spec)


def run_per_mesh(func: Any, args: tuple, kwargs: dict, call: Callable, wrap: Callable) -> Any:
    """``func`` once per mesh of its first list argument; ``call`` dispatches one group."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    first = bound[names[0]]
    n = len(first)
    groups: dict[DeviceMesh | None, list[int]] = {}
    for i, t in enumerate(first):
        groups.setdefault(_mesh_of(t), []).append(i)
    results = []
    for mesh, idx in groups.items():
        part = {}
        for k, v in bound.items():
            if isinstance(v, (list, tuple)) and len(v) == n:
                part[k] = [v[i] for i in idx]
            else:
                part[k] = v if mesh is None else _onto(v, mesh, func, wrap)
        pos = [part.pop(k) for k in names[:len(args)]]
        results.append((idx, call(func, tuple(pos), part)))
    return _merge(results, n)


def _merge(results: list[tuple[list[int], Any]], n: int) -> Any:
    out = results[0][1]
    if out is None:
        return None
    if isinstance(out, tuple):  # several list outputs
        return tuple(_merge([(idx, r[k]) for idx, r in results], n) for k in range(len(out)))
    merged: list[Any] = [None] * n
    for idx, r in results:
        for i, x in zip(idx, r):
            merged[i] = x
    return merged
