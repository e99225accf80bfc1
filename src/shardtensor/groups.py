"""``DeviceMesh.get_group``, in a file dynamo traces (``compile._DYNAMO_READS``).

Code that runs its own collectives on a mesh's process group (Hugging Face's tensor parallel
layers at inference: ``dist.all_reduce(out, group=mesh.get_group())``) calls ``get_group`` inside
compiled forwards.  A process group enters a graph only from a place dynamo can guard, a module
global, so each group a mesh hands out is kept in ``GROUPS`` under a key that compiled code reads
as a constant (``DeviceMesh._group_key``).  A mesh puts its groups there when it is built
(``remember``), so compiled code finds them; a group of one rank is built by its first call.
"""
from __future__ import annotations

from typing import Any

GROUPS: dict[tuple[int, tuple[int, ...]], Any] = {}
"""(``Transport.group_serial``, the group's ranks) -> torch.distributed's ProcessGroup.  A key of
serial -1 is never stored, so compiled code finds those groups eagerly."""


def get_group(mesh: Any, mesh_dim: int | str | None = None) -> Any:
    """torch.distributed's ProcessGroup of this rank's group along ``mesh_dim`` (under torchrun; the
    simulated world has none and says so)."""
    key = mesh._group_key(mesh_dim)
    group = GROUPS.get(key)
    if group is None:
        group = mesh._new_group(key)
        if key[0] >= 0:  # -1: ranks that are threads sharing dynamo's cache find their group eagerly
            GROUPS[key] = group
    return group


def remember(mesh: Any) -> None:
    """Keeps this rank's group along each dim of ``mesh`` (of more than one rank), where its world has
    process groups: compiled code then finds them without building one (a graph break)."""
    if mesh.transport.group_serial < 0 or mesh.get_coordinate() is None:
        return
    for dim, size in enumerate(mesh.shape):
        if size > 1:
            get_group(mesh, dim)


def resolving_meshes(theirs: Any, mesh_type: Any) -> Any:
    """torch's functional collectives' group resolver (``_resolve_group``; ``_resolve_group_name``
    before torch 2.13), also taking this library's meshes as torch's take its own: ``group=mesh``
    (1-D) or ``group=(mesh, dim)`` is that mesh dim's process group.  The drop-in installs it;
    here, since compiled code runs it."""

    def resolve(group: Any, tag: str = "") -> Any:
        if isinstance(group, mesh_type):
            if group.ndim != 1:
                raise ValueError(f"a {group.ndim}-D mesh as a collective's group: pass (mesh, mesh_dim)")
            group = get_group(group, 0)
        elif isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], mesh_type):
            group = get_group(group[0], group[1])
        return theirs(group, tag)

    return resolve
