"""Placements (Shard / Replicate / Partial; StridedShard for packed layouts) and the arithmetic
of local shapes and offsets.

A placement says how one mesh dimension holds a tensor.  The arithmetic here is pure: it
maps (global shape, mesh shape, coordinate, placements, shard order) to the local shape and
global offset of a rank, following the torch.chunk rule (uneven and empty pieces are legal)
and nested sharding (several mesh dims splitting one tensor dim, in an explicit order).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


class Placement:
    """Base class of the three placements; mirrors ``torch.distributed.tensor.Placement``."""

    __slots__ = ("__weakref__",)  # torch.compile keeps weak references to graph constants

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    def local_grad(self) -> "Placement":
        """The placement of the gradient a rank's local tensor receives (``to_local``'s backward
        default): where each rank's local gradient is dL/d(its local tensor), the placement that
        makes them the gradient of the global value.  A shard or a replica keeps its placement."""
        return self


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Tensor dim ``dim`` is split across the mesh dim by the torch.chunk rule."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard dim must be an int, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    @staticmethod
    def local_shard_size_and_offset(curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """Size and offset of piece ``rank`` of ``num_chunks`` torch.chunk pieces of a length
        (torch's public static method; the offset is relative to that length)."""
        return chunk(curr_local_size, num_chunks, rank)

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __fx_repr__(self) -> tuple[str, dict]:  # torch.compile writes the placement into graph code
        return f"Shard({self.dim})", {"Shard": Shard}

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True, init=False)
class StridedShard(Placement):
    """Tensor dim ``dim`` is cut into ``split_factor`` groups and each group is split across the
    mesh dim (both by the torch.chunk rule); a rank holds its piece of every group, in group order.

    The layout of a fused weight (a packed gate/up projection: each rank holds its slice of both
    halves) and torch's ``_StridedShard`` (also spelled with ``sf=``).  It applies after every
    ``Shard`` of the same tensor dim, so it comes after them in the placements.  Ops other than
    elementwise ones on matching layouts see it gathered first (``dispatch``): exact, never
    guessed.  Not a ``Shard``: ``is_shard()`` is False, as for torch's.
    """

    dim: int
    split_factor: int

    def __init__(self, dim: int, split_factor: int = 1, *, sf: int | None = None) -> None:
        if sf is not None:
            if split_factor != 1:
                raise TypeError("StridedShard: give split_factor or sf, not both")
            split_factor = sf
        for name, v in (("dim", dim), ("split_factor", split_factor)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"StridedShard {name} must be an int, got {v!r}")
        if split_factor < 1:
            raise ValueError(f"StridedShard split_factor must be at least 1, got {split_factor}")
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "split_factor", split_factor)

    @property
    def sf(self) -> int:
        return self.split_factor

    def __repr__(self) -> str:
        return f"StridedShard(dim={self.dim}, split_factor={self.split_factor})"

    def __fx_repr__(self) -> tuple[str, dict]:
        return repr(self), {"StridedShard": StridedShard}

    def __str__(self) -> str:
        return f"SS({self.dim},{self.split_factor})"


def strided_runs(length: int, split_factor: int, k: int, r: int) -> list[tuple[int, int]]:
    """``(size, offset)`` of each group's piece that rank ``r`` of ``k`` holds under a
    ``StridedShard`` of ``split_factor`` groups of a dim of ``length`` (offsets within it)."""
    runs = []
    for g in range(split_factor):
        g_size, g_off = chunk(length, split_factor, g)
        size, off = chunk(g_size, k, r)
        runs.append((size, g_off + off))
    return runs


def has_strided(placements: Sequence[Placement]) -> bool:
    return any(type(p) is StridedShard for p in placements)


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank of the mesh dim holds the whole value."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"

    def __fx_repr__(self) -> tuple[str, dict]:
        return "Replicate()", {"Replicate": Replicate}

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Every rank holds a term; the value is ``reduce_op`` over the mesh dim's ranks."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op == "prod":  # torch's spelling of the same reduction
            object.__setattr__(self, "reduce_op", "product")
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(f"Partial reduce_op must be one of {REDUCE_OPS}, got {self.reduce_op!r}")

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def local_grad(self) -> Placement:
        """A sum's terms each get the whole gradient (``Replicate``); an average's get 1/n of it
        and a max's or min's the gradient where they win, so their sum is the gradient.  A
        product's has no placement (each term's gradient is divided by the term)."""
        if self.reduce_op == "sum":
            return Replicate()
        if self.reduce_op == "product":
            raise NotImplementedError("to_local() of a Partial(product) DTensor: its gradient has no placement; "
                                      "pass grad_placements= to say what the local gradients are")
        return Partial("sum")

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    def __fx_repr__(self) -> tuple[str, dict]:
        return f"Partial({self.reduce_op!r})", {"Partial": Partial}

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


@dataclass(frozen=True, slots=True, init=False, repr=False)
class NormPartial(Partial):
    """p-norm partial ``PN(p)``: each rank holds the p-norm of its part of the data.

    The global value is the p-norm of the local norms: max for ``inf``, min for ``-inf``,
    a plain sum for 0 and 1, and ``(sum L^p)^(1/p)`` for any other ``p`` (the collective sums
    ``L^p`` in fp32).  Equal only to a ``NormPartial`` with the same ``p``.
    """

    norm: float  # type: ignore[misc]  # set by __init__ (a dataclass field without a default)

    def __init__(self, norm: float | str = 2.0) -> None:
        if isinstance(norm, str):
            if norm not in ("inf", "-inf"):
                raise NotImplementedError(f"NormPartial: unsupported norm {norm!r}")
            norm = float(norm)
        if isinstance(norm, (complex, bool)) or not isinstance(norm, (int, float)) or norm != norm:
            raise NotImplementedError(f"NormPartial: unsupported norm {norm!r}")
        norm = float(norm)
        op = "max" if norm == float("inf") else "min" if norm == float("-inf") else "sum"
        object.__setattr__(self, "reduce_op", op)
        object.__setattr__(self, "norm", norm)

    def local_grad(self) -> Placement:
        """Norms 0 and 1 add (``Replicate``), the infinite ones are a max or min; any other norm's
        terms have gradients scaled by their own value: no placement."""
        if self.norm in (0.0, 1.0, float("inf"), float("-inf")):
            return Partial.local_grad(Partial(self.reduce_op))
        raise NotImplementedError(f"to_local() of a {self!r} DTensor: its gradient has no placement; "
                                  "pass grad_placements= to say what the local gradients are")

    def __repr__(self) -> str:
        return f"NormPartial({self.norm:g})"

    def __fx_repr__(self) -> tuple[str, dict]:
        return f"NormPartial(float({str(self.norm)!r}))", {"NormPartial": NormPartial}

    def __str__(self) -> str:
        return f"PN({self.norm:g})"


ShardOrder = tuple[tuple[int, tuple[int, ...]], ...]
"""``((tensor_dim, (mesh_dim, ...)), ...)`` sorted by tensor dim, first-applied mesh dim first."""


def unpartial(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """Every Partial -> Replicate: the placements once the pending reductions are done."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def chunk(length: int, k: int, r: int) -> tuple[int, int]:
    """Size and offset of piece ``r`` when ``length`` is split into ``k`` torch.chunk pieces."""
    c = -(-length // k) if length else 0
    offset = min(c * r, length)
    return min(c, length - offset), offset


def chunk_sizes(length: int, k: int) -> list[int]:
    return [chunk(length, k, r)[0] for r in range(k)]


def unfake(x: Any) -> Any:
    """The real placement or mesh behind the stand-in torch.compile passes to code it runs
    eagerly after a graph break (a ``FakeScriptObject`` of an opaque value: ``compile.py``)."""
    if type(x).__name__ == "FakeScriptObject":
        return object.__getattribute__(x, "real_obj")
    return x


def normalize_placements(placements: Sequence[Placement], ndim: int, mesh_ndim: int) -> tuple[Placement, ...]:
    """Validate placements for a tensor of ``ndim`` dims on a mesh of ``mesh_ndim`` dims.

    Negative shard dims are wrapped; out-of-range dims, wrong counts and non-placements raise.
    """
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise TypeError(f"placements must be a sequence of Placement, got {placements!r}")
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"got {len(placements)} placements {tuple(placements)} for a mesh with {mesh_ndim} dims; "
            "give exactly one placement per mesh dim"
        )
    out = []
    for p in placements:
        p = unfake(p)
        if not isinstance(p, Placement):
            raise TypeError(f"placement must be Shard, Replicate or Partial, got {p!r}")
        if isinstance(p, (Shard, StridedShard)):
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise ValueError(f"{p!r} is out of range for a tensor with {ndim} dims")
            if isinstance(p, StridedShard):
                p = Shard(d) if p.split_factor == 1 else StridedShard(d, p.split_factor) if d != p.dim else p
            else:
                p = Shard(d) if d != p.dim else p
        out.append(p)
    _check_strided(out)
    return tuple(out)


def _check_strided(placements: Sequence[Placement]) -> None:
    """A ``StridedShard`` splits its tensor dim last: one per dim, after every ``Shard`` of it."""
    seen: set[int] = set()
    for j, p in enumerate(placements):
        if type(p) is not StridedShard:
            continue
        if p.dim in seen:
            raise NotImplementedError(f"placements {tuple(placements)}: two StridedShard of tensor dim {p.dim}")
        seen.add(p.dim)
        if any(isinstance(q, Shard) and q.dim == p.dim for q in placements[j + 1:]):
            raise NotImplementedError(
                f"placements {tuple(placements)}: a Shard({p.dim}) after StridedShard({p.dim}) (torch's right-to-left "
                "sharding) is written in shardtensor as Shard on both mesh dims with a shard_order that lists the "
                "later mesh dim first")


def default_shard_order(placements: Sequence[Placement]) -> ShardOrder:
    """Mesh dims left to right within each sharded tensor dim."""
    by_dim: dict[int, list[int]] = {}
    for j, p in enumerate(placements):
        if isinstance(p, Shard):
            by_dim.setdefault(p.dim, []).append(j)
    return tuple((d, tuple(js)) for d, js in sorted(by_dim.items()))


def validate_shard_order(placements: Sequence[Placement], order: ShardOrder) -> ShardOrder:
    """Check that ``order`` lists exactly the sharding mesh dims of each tensor dim."""
    def as_int(v: object) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"shard order {order!r}: dims must be ints, got {v!r}")
        return v

    entries = [(as_int(d), tuple(as_int(j) for j in js)) for d, js in order]
    dims = [d for d, _ in entries]
    if len(set(dims)) != len(dims):
        raise ValueError(f"shard order {order!r} lists a tensor dim twice; give one entry per sharded tensor dim")
    order = tuple(sorted(entries))
    seen: list[int] = []
    for d, js in order:
        if not js:
            raise ValueError(f"shard order {order}: tensor dim {d} has an empty mesh-dim list")
        for j in js:
            if not 0 <= j < len(placements) or placements[j] != Shard(d):
                raise ValueError(f"shard order {order}: mesh dim {j} is not Shard({d}) in {tuple(placements)}")
            seen.append(j)
    expected = sorted(j for j, p in enumerate(placements) if isinstance(p, Shard))
    if sorted(seen) != expected:
        raise ValueError(f"shard order {order} does not list each sharding mesh dim of {tuple(placements)} once")
    return order


def execution_order(placements: Sequence[Placement], order: ShardOrder | None) -> list[int]:
    """Mesh dims that shard, in the order they split (tensor dims are independent)."""
    if order is None:
        return [j for j, p in enumerate(placements) if isinstance(p, Shard)]
    return [j for _, js in order for j in js]


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int] | None,
    placements: Sequence[Placement],
    order: ShardOrder | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of the rank at ``coordinate`` (docs/placements.md).

    An empty piece reports the global length as its offset; a rank outside the mesh
    (``coordinate=None``) gets shape ``(0,)`` and an empty offset.
    """
    if coordinate is None:
        return (0,), ()
    shape = list(global_shape)
    offset = [0] * len(shape)
    for j in execution_order(placements, order):
        d = placements[j].dim  # type: ignore[attr-defined]  # execution_order yields shards only
        s, o = chunk(shape[d], mesh_shape[j], coordinate[j])
        shape[d] = s
        offset[d] = global_shape[d] if s == 0 else offset[d] + o
    for j, p in enumerate(placements):  # a StridedShard splits last; its offset is its first element's
        if type(p) is StridedShard and shape[p.dim]:
            runs = [(s, o) for s, o in strided_runs(shape[p.dim], p.split_factor, mesh_shape[j], coordinate[j]) if s]
            shape[p.dim] = sum(s for s, _ in runs)
            offset[p.dim] = offset[p.dim] + runs[0][1] if runs else global_shape[p.dim]
    return tuple(shape), tuple(offset)


def local_blocks(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                 placements: Sequence[Placement], order: ShardOrder | None = None
                 ) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """The boxes of the global tensor that the rank at ``coordinate`` holds, none empty:
    ``(sizes, global offsets, offsets in its local tensor)``.  One box, or with a StridedShard
    one per group piece (per combination, when several dims are packed)."""
    plain = [Replicate() if type(p) is StridedShard else p for p in placements]
    sizes, offsets = local_shape_and_offset(global_shape, mesh_shape, coordinate, plain, order)
    per_dim = [[(n, o, 0)] for n, o in zip(sizes, offsets)]
    for j, p in enumerate(placements):
        if type(p) is StridedShard:
            runs, at = [], 0
            for n, o in strided_runs(sizes[p.dim], p.split_factor, mesh_shape[j], coordinate[j]):
                runs.append((n, offsets[p.dim] + o, at))
                at += n
            per_dim[p.dim] = runs
    return [(tuple(r[0] for r in combo), tuple(r[1] for r in combo), tuple(r[2] for r in combo))
            for combo in itertools.product(*per_dim) if all(r[0] for r in combo)]


def compute_local_shape(global_shape, mesh_shape, coordinate, placements, order=None) -> tuple[int, ...]:
    return local_shape_and_offset(global_shape, mesh_shape, coordinate, placements, order)[0]


class OrderedPlacements(tuple):
    """A DTensor's placements when its nested shard order is not the default one.

    Equal to (and hashes as) the plain tuple, so comparisons with ``(Shard(0), Shard(0))`` hold;
    its repr marks each mesh dim's position in its tensor dim's split order
    (``(Shard(dim=0)[1], Shard(dim=0)[0])``: mesh dim 1 splits dim 0 first), and passing it back
    as ``placements=`` (to ``redistribute``, ``from_local``, ``distribute_tensor``) keeps the order.
    """

    shard_order: ShardOrder

    def __new__(cls, placements: Sequence[Placement], shard_order: ShardOrder) -> "OrderedPlacements":
        out = super().__new__(cls, placements)
        out.shard_order = shard_order
        return out

    def __getnewargs__(self) -> tuple:  # type: ignore[override]
        return tuple(self), self.shard_order

    def __repr__(self) -> str:
        pos = {j: i for _, js in self.shard_order for i, j in enumerate(js) if len(js) > 1}
        return "(" + ", ".join(repr(p) + (f"[{pos[j]}]" if j in pos else "") for j, p in enumerate(self)) + ")"


def display(placements: Sequence[Placement], order: ShardOrder | None = None) -> str:
    """Compact form: ``S(0)[1]S(0)[0]`` marks each mesh dim's position in a nested tensor dim."""
    order = order if order is not None else default_shard_order(placements)
    pos = {j: (i, len(js)) for _, js in order for i, j in enumerate(js)}
    parts = []
    for j, p in enumerate(placements):
        s = str(p)
        if j in pos and pos[j][1] > 1:
            s += f"[{pos[j][0]}]"
        parts.append(s)
    return "(" + ", ".join(parts) + ")"
