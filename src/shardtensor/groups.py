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
