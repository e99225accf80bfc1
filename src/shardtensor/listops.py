"""List ops (``_foreach_*``, ``_fused_*``) over DTensors of several meshes: one call per mesh.

After torch's 2-D recipe the TP weights live on the 2-D mesh and the norm weights on
``mesh["dp"]``; an optimizer step or ``_foreach_norm`` takes them all in one list.  The list is
split by the mesh of each element of the first list, the op runs once per mesh (in the order the
meshes first appear, the same on every rank), and the results are put back in list order, each
output on its own input's mesh.  A single tensor argument on another mesh (a learning rate or a
clip coefficient) is taken as-is when it is replicated over a mesh covering the group's ranks.

Plain tensors in the first list are a group of their own, run as plain tensors (a TP model's
unsharded norm weights in one optimizer step with its sharded weights): what a loop of
single-tensor ops would do, with no DTensor dispatch and no question whether ranks agree.
"""
from __future__ import annotations

from typing import Any, Callable

from .mesh import DeviceMesh
from .placement import Replicate
from .propagation import MeshMismatchError
from .spec import DTensorSpec

__all__ = ["is_list_op", "run_per_mesh", "splits_plain"]

_LIST_OPS: dict[int, bool] = {}


def is_list_op(func: Any) -> bool:
    r = _LIST_OPS.get(id(func))
    if r is None:
        args = func._schema.arguments
        name = func._schema.name.split("::")[-1]
        r = _LIST_OPS[id(func)] = (bool(args) and str(args[0].type) == "List[Tensor]"
                                   and name.startswith(("_foreach_", "_fused_")))
    return r


def splits_plain(func: Any, args: tuple) -> bool:
    """Whether ``func`` is a list op whose first list holds both DTensors and plain tensors."""
    if not args or not isinstance(args[0], (list, tuple)) or not is_list_op(func):
        return False
    kinds = {_mesh_of(t) is None for t in args[0]}
    return len(kinds) == 2


def _mesh_of(t: Any) -> DeviceMesh | None:
    spec = getattr(t, "_spec", None)
    return spec.mesh if isinstance(spec, DTensorSpec) else None


def _onto(t: Any, mesh: DeviceMesh, func: Any, wrap: Callable) -> Any:
    """A single tensor argument moved onto ``mesh`` where its value is already there on every rank."""
    m = _mesh_of(t)
    if m is None or m == mesh:
        return t
    covers = set(mesh._all) <= set(m._all)  # rank tuples, no tensor op: fake tensors under compile
    if not covers or not all(p.is_replicate() for p in t._spec.placements):
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
        plain = _as_plain(pos, part) if mesh is None else None
        results.append((idx, func(*plain[0], **plain[1]) if plain is not None else call(func, tuple(pos), part)))
    return _merge(results, n)


def _as_plain(pos: list, part: dict) -> tuple[list, dict] | None:
    """A group of plain list elements as a plain call's arguments, where every other list is plain
    too and every single tensor plain or a replicated DTensor (a clip coefficient: its local
    value); else ``None`` (the group dispatches, with its plain tensors as replicated values)."""
    for v in [*pos, *part.values()]:
        if isinstance(v, (list, tuple)):
            if any(_mesh_of(t) is not None for t in v):
                return None
        elif _mesh_of(v) is not None and not all(p.is_replicate() for p in v._spec.placements):
            return None
    return [_local(v) for v in pos], {k: _local(v) for k, v in part.items()}


def _local(v: Any) -> Any:
    return v._local_tensor if _mesh_of(v) is not None else v


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
