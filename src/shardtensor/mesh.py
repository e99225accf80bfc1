"""DeviceMesh: an n-D array of ranks with named dims, one communication group per mesh dim."""
from __future__ import annotations

import itertools
import math
import threading
from typing import Any, Sequence

import torch

from .comm import Transport, current_transport
from . import groups
from .comm.base import Group
from .placement import unfake


class DeviceMesh:
    """Ranks arranged as an n-D array; mirrors ``torch.distributed.device_mesh.DeviceMesh``.

    A mesh is built by every rank with the same arguments.  Each rank finds its coordinate
    and, for each mesh dim, the group of ranks that share all its other coordinates.
    """

    def __init__(self, device_type: str, mesh: torch.Tensor | Sequence, *, mesh_dim_names: Sequence[str] | None = None,
                 _transport: Transport | None = None, _prepare: bool = True) -> None:
        if not isinstance(device_type, str):
            raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}")
        ranks = mesh.detach().to("cpu", torch.int64) if isinstance(mesh, torch.Tensor) else torch.tensor(mesh, dtype=torch.int64)
        if ranks.ndim == 0 or ranks.numel() == 0:
            raise ValueError(f"mesh must be a non-empty array of ranks, got {mesh!r}")
        flat = ranks.flatten().tolist()
        if len(set(flat)) != len(flat):
            raise ValueError(f"mesh lists a rank twice: {ranks.tolist()}")
        self.device_type = device_type
        self.mesh = ranks
        transport = _transport if _transport is not None else current_transport()
        if max(flat) >= transport.world_size or min(flat) < 0:
            raise ValueError(f"mesh {ranks.tolist()} names ranks outside the world of size {transport.world_size}")
        if mesh_dim_names is not None:
            mesh_dim_names = tuple(mesh_dim_names)
            if len(mesh_dim_names) != ranks.ndim or len(set(mesh_dim_names)) != ranks.ndim:
                raise ValueError(f"mesh_dim_names {mesh_dim_names} must be {ranks.ndim} distinct names")
        self.mesh_dim_names: tuple[str, ...] | None = mesh_dim_names
        self._shape = tuple(ranks.shape)
        self.shape: tuple[int, ...] = self._shape
        self.ndim: int = len(self._shape)
        self._all: Group = tuple(flat)
        self._coords: dict[int, tuple[int, ...]] = {r: c for r, c in zip(flat, _row_major(self._shape))}
        self._rank_at = {c: r for r, c in self._coords.items()}
        self._groups: dict[int, dict[int | tuple[int, ...], Group]] = {}
        self._key = (device_type, self._shape, self._all, mesh_dim_names)
        self._hash = hash(self._key)
        self._root: DeviceMesh | None = None  # the mesh this one was cut from by mesh[...], and its dims there
        self._root_dims: tuple[int, ...] = tuple(range(ranks.ndim))
        self._flattened: dict[str, tuple[int, ...]] = {}  # root only: _flatten's names -> the dims they join
        if _prepare:
            transport.prepare_groups(self._all_groups())
            groups.remember(self)

    def _all_groups(self) -> list[Group]:
        """Every group a collective may use: each mesh dim's, each flattened set of mesh dims'
        (for one collective over several dims), and the whole mesh."""
        out: list[Group] = []
        m = self.mesh.ndim
        for r in range(1, m):
            for dims in itertools.combinations(range(m), r):
                rest = [j for j in range(m) if j not in dims]
                size = math.prod(self._shape[j] for j in dims)
                if size == 1:
                    continue
                moved = self.mesh.permute(rest + list(dims)).reshape(-1, size)
                out.extend(tuple(row) for row in moved.tolist())
        out.append(self._all)
        return out

    # -- the torch-compatible surface (shape and ndim are set in __init__: plain attributes,
    # which torch.compile reads on a mesh inside compiled code, where it cannot call a property)
    def size(self, mesh_dim: int | None = None) -> int:
        return self.mesh.numel() if mesh_dim is None else self._shape[self._dim(mesh_dim)]

    @property
    def transport(self) -> Transport:
        """The calling rank's transport (a mesh describes ranks; it holds no rank state)."""
        return current_transport()

    def get_rank(self) -> int:
        return self.transport.rank

    @property
    def _coord(self) -> tuple[int, ...] | None:
        return self._coords.get(current_transport().rank)

    def get_coordinate(self) -> list[int] | None:
        """This rank's coordinate, or ``None`` if it is not in the mesh."""
        c = self._coord
        return list(c) if c is not None else None

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError("get_local_rank() needs mesh_dim on a mesh with more than one dim")
            mesh_dim = 0
        if self._coord is None:
            raise RuntimeError(f"rank {self.transport.rank} is not in mesh {self._rank_grid()}")
        return self._coord[self._dim(mesh_dim)]

    get_group = groups.get_group

    def _group_key(self, mesh_dim: int | str | None) -> tuple[int, Group]:
        """``get_group``'s key in ``groups.GROUPS``: the transport's ``group_serial`` and the ranks of
        this rank's group along ``mesh_dim`` (a constant of compiled code)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_group() needs mesh_dim on a {self.ndim}-D mesh; get_all_groups() gives one per dim")
            mesh_dim = 0
        dim = self._dim(mesh_dim)
        if self._coord is None:
            raise RuntimeError(f"rank {self.transport.rank} is not in mesh {self._rank_grid()}, so it has no group there")
        return self.transport.group_serial, self.group_ranks(dim)

    def _new_group(self, key: tuple[int, Group]) -> Any:
        return self.transport.process_group(key[1])

    def get_all_groups(self) -> list[Any]:
        """One ProcessGroup per mesh dim, in order."""
        return [self.get_group(j) for j in range(self.ndim)]

    def _dim(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"mesh has no dim named {mesh_dim!r}; its names are {self.mesh_dim_names}")
            return self.mesh_dim_names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dim {mesh_dim} out of range for a {self.ndim}-D mesh")
        return mesh_dim % self.ndim

    def __getitem__(self, names: str | int | Sequence[str | int]) -> "DeviceMesh":
        """Sub-mesh of the named dims that contains this rank (shares this mesh's groups); a
        name given to ``_flatten`` gives that flattened mesh."""
        if isinstance(names, (str, int)):
            names = (names,)
        root = self._root if self._root is not None else self
        flat = [n for n in names if isinstance(n, str) and n in root._flattened
                and not (self.mesh_dim_names and n in self.mesh_dim_names)]
        if flat:
            if len(names) > 1:
                raise NotImplementedError(f"mesh[{names!r}]: a flattened dim ({flat[0]!r}) is sliced alone")
            return root._flat_mesh(flat[0], root._flattened[flat[0]])
        dims = [self._dim(n) for n in names]
        if len(set(dims)) != len(dims):
            raise ValueError(f"mesh dims {names} repeat")
        if self._coord is None:
            raise RuntimeError(f"rank {self.transport.rank} is not in mesh {self._rank_grid()}")
        idx: list[object] = list(self._coord)
        for d in dims:
            idx[d] = slice(None)
        sub = self.mesh[tuple(idx)]  # type: ignore[index]  # ints and slices
        keep = sorted(dims)
        sub = sub.permute([keep.index(d) for d in dims]) if keep != dims else sub
        names_out = tuple(self.mesh_dim_names[d] for d in dims) if self.mesh_dim_names else None
        out = DeviceMesh(self.device_type, sub, mesh_dim_names=names_out, _prepare=False)
        out._root = self._root if self._root is not None else self
        out._root_dims = tuple(self._root_dims[d] for d in dims)
        return out

    def _flatten(self, mesh_dim_name: str | None = None, backend_override: Any = None) -> "DeviceMesh":
        """This mesh's dims as one dim (row-major): a 1-D mesh of its ranks, which the mesh it
        was cut from also gives as ``mesh[mesh_dim_name]`` (torch's private API, used by
        torchtitan; ``backend_override`` is accepted: the groups exist already)."""
        root = self._root if self._root is not None else self
        name = mesh_dim_name if mesh_dim_name is not None else "_".join(self.mesh_dim_names or ())
        if not isinstance(name, str) or not name:
            raise ValueError("_flatten: give mesh_dim_name (this mesh's dims have no names to join)")
        dims = self._root_dims
        if root.mesh_dim_names and name in root.mesh_dim_names and (len(dims) != 1 or root.mesh_dim_names[dims[0]] != name):
            raise ValueError(f"_flatten: {name!r} already names a dim of {root!r}")
        if root._flattened.get(name, dims) != dims:
            raise ValueError(f"_flatten: {name!r} already names another flattened set of dims")
        root._flattened[name] = dims
        return root._flat_mesh(name, dims)

    def _flat_mesh(self, name: str, dims: tuple[int, ...]) -> "DeviceMesh":
        """Root only: this rank's group along ``dims`` as a 1-D mesh named ``name`` (the root
        prepared every group of every set of its dims)."""
        if self._coord is None:
            raise RuntimeError(f"rank {self.transport.rank} is not in mesh {self._rank_grid()}")
        ranks = self.group_ranks(dims) if dims != tuple(range(self.ndim)) else self._all
        return DeviceMesh(self.device_type, list(ranks), mesh_dim_names=(name,), _prepare=False)

    def _unflatten(self, dim: int | str, mesh_sizes: Sequence[int], mesh_dim_names: Sequence[str],
                   backend_override: Any = None) -> "DeviceMesh":
        """This mesh with dim ``dim`` split into ``mesh_sizes`` named ``mesh_dim_names``
        (row-major; torch's private API, used by torchtitan to build its meshes from one world
        mesh).  Every rank calls it alike: the new mesh's groups are made for the whole world."""
        d = self._dim(dim)
        sizes, names = tuple(mesh_sizes), tuple(mesh_dim_names)
        if len(sizes) != len(names) or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"_unflatten: mesh_sizes {sizes} and mesh_dim_names {names} must be as many positive sizes as names")
        if math.prod(sizes) != self._shape[d]:
            raise ValueError(f"_unflatten: mesh_sizes {sizes} multiply to {math.prod(sizes)}, not to dim {dim!r}'s size {self._shape[d]}")
        if backend_override is not None and set(backend_override) - set(names):
            raise ValueError(f"_unflatten: backend_override names {sorted(set(backend_override) - set(names))}, "
                             f"which are not among mesh_dim_names {names}")
        root = self._root if self._root is not None else self
        rd = self._root_dims[d]
        old = root.mesh_dim_names or tuple(f"dim{j}" for j in range(root.ndim))
        new_names = old[:rd] + names + old[rd + 1:]
        grid = root.mesh.reshape(root._shape[:rd] + sizes + root._shape[rd + 1:])
        new_root = DeviceMesh(root.device_type, grid, mesh_dim_names=new_names)
        if self is root:
            return new_root
        kept = [j + (len(sizes) - 1 if j > rd else 0) for j in self._root_dims]
        at = kept.index(rd)
        kept[at: at + 1] = range(rd, rd + len(sizes))
        return new_root[tuple(new_names[j] for j in kept)]

    # -- what the comm layer needs -----------------------------------------------------
    def group_ranks(self, mesh_dim: int | tuple[int, ...] | None) -> Group:
        """Global ranks of this rank's group along ``mesh_dim`` (``None``: the whole mesh).

        A tuple of mesh dims names their flattened group, ordered row-major over the dims as
        listed (the first is the most significant).
        """
        if mesh_dim is None:
            return self._all
        rank = current_transport().rank
        groups = self._groups.get(rank)
        if groups is None:
            groups = self._groups[rank] = self._groups_through(self._coords[rank])
        if isinstance(mesh_dim, tuple):
            g = groups.get(mesh_dim)
            if g is None:
                g = groups[mesh_dim] = self._group_along(self._coords[rank], mesh_dim)
            return g
        return groups[mesh_dim]

    def _groups_through(self, coord: tuple[int, ...]) -> dict[int | tuple[int, ...], Group]:
        return {j: self._group_along(coord, (j,)) for j in range(self.ndim)}

    def _group_along(self, coord: tuple[int, ...], dims: tuple[int, ...]) -> Group:
        """The ranks sharing ``coord`` off ``dims``, row-major over ``dims`` as listed.

        Plain Python, no tensor ops: it may first run while torch.compile traces with fake tensors.
        """
        out = []
        for sub in itertools.product(*(range(self._shape[j]) for j in dims)):
            c = list(coord)
            for j, i in zip(dims, sub):
                c[j] = i
            out.append(self._rank_at[tuple(c)])
        return tuple(out)

    def group_size(self, mesh_dim: int | tuple[int, ...] | None) -> int:
        if mesh_dim is None:
            return len(self._all)
        if isinstance(mesh_dim, tuple):
            return math.prod(self._shape[j] for j in mesh_dim)
        return self._shape[mesh_dim]

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    def __enter__(self) -> "DeviceMesh":
        """``with mesh:`` makes this the default mesh of distribute_tensor, from_local and
        parallelize_module inside the block (per thread, so per simulated rank; blocks nest)."""
        _current.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _current.stack.pop()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __deepcopy__(self, memo: dict) -> "DeviceMesh":  # a mesh describes ranks; it is never changed
        return self

    def __fx_repr__(self) -> tuple[str, dict]:
        """How torch.compile writes this mesh into graph code: a lookup by its key."""
        _BY_KEY.setdefault(self._key, self)
        return f"mesh_of({self._key!r})", {"mesh_of": mesh_of}

    def _rank_grid(self) -> list:
        """The rank grid as nested lists (``mesh.tolist()``, without a tensor op: safe inside
        compiled code, where tensor ops see fake tensors)."""
        out: list = list(self._all)
        for n in reversed(self._shape[1:]):
            out = [out[i:i + n] for i in range(0, len(out), n)]
        return out

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh('{self.device_type}', {self._rank_grid()}{names})"


_BY_KEY: dict[tuple, DeviceMesh] = {}


def mesh_of(key: tuple) -> DeviceMesh:
    """The mesh with this key (``DeviceMesh._key``): one seen before, else a new one."""
    mesh = _BY_KEY.get(key)
    if mesh is None:
        device_type, shape, ranks, names = key
        mesh = _BY_KEY.setdefault(key, DeviceMesh(device_type, torch.tensor(ranks).reshape(shape), mesh_dim_names=names))
    return mesh


class _Current(threading.local):
    def __init__(self) -> None:
        self.stack: list[DeviceMesh] = []


_current = _Current()


def current_mesh() -> DeviceMesh | None:
    """The mesh of the innermost ``with mesh:`` block of this thread (simulated rank), or None."""
    return _current.stack[-1] if _current.stack else None


def joined_mesh(a: DeviceMesh, b: DeviceMesh) -> DeviceMesh | None:
    """The mesh over ``a``'s dims then ``b``'s, cut from the mesh ``a`` was cut from (torch's 2-D
    recipe: ``mesh["dp"]`` and ``mesh["tp"]`` give back ``mesh``); None if ``b`` is no other part
    of that mesh.  ``b`` is matched by value: equal meshes may be different objects."""
    root = a._root if a._root is not None else a
    rest = [d for d in range(root.ndim) if d not in a._root_dims]
    for dims in itertools.permutations(rest, b.ndim):
        if root[dims] == b:
            full = a._root_dims + dims
            return root if full == tuple(range(root.ndim)) else root[full]
    return None


def resolve_mesh(device_mesh: Any, who: str) -> DeviceMesh:
    """``device_mesh`` checked, or the current mesh when it is None."""
    if device_mesh is None:
        device_mesh = current_mesh()
        if device_mesh is None:
            raise ValueError(f"{who} needs device_mesh: pass one, or call it inside a `with mesh:` block")
    device_mesh = unfake(device_mesh)
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"{who}: device_mesh must be a shardtensor DeviceMesh, got {device_mesh!r}")
    return device_mesh


def _row_major(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    coords: list[tuple[int, ...]] = [()]
    for s in shape:
        coords = [c + (i,) for c in coords for i in range(s)]
    return coords


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """A mesh of every rank of the current world, in row-major order.

    The world is the simulated one inside ``run_spmd``, torch.distributed's default group
    when it is initialised, otherwise a world of one rank.
    """
    if isinstance(mesh_shape, int):
        raise TypeError(f"init_device_mesh: mesh_shape must be a tuple of ints, one per mesh dim: write "
                        f"({mesh_shape},) for a 1-D mesh of {mesh_shape} ranks, got the int {mesh_shape}")
    shape = tuple(mesh_shape)
    if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shape):
        raise ValueError(f"mesh_shape must be a non-empty tuple of positive ints, got {mesh_shape!r}")
    transport = current_transport()
    n = 1
    for s in shape:
        n *= s
    if n != transport.world_size:
        raise ValueError(
            f"mesh shape {shape} holds {n} ranks but the world has {transport.world_size} "
            f"({transport.name}); run inside run_spmd(fn, world_size={n}) or torchrun with {n} processes"
        )
    return DeviceMesh(device_type, torch.arange(n).reshape(shape), mesh_dim_names=mesh_dim_names, _transport=transport)
