"""The placement interface: what the library asks of every placement, answered by the placement.

A placement says how one mesh dimension holds a tensor.  Code elsewhere never checks a
placement's class to learn its behaviour; it asks:

* ``tensor_dim()`` and ``pieces(length, k, r)``: which tensor dim it splits and the runs
  ``(size, offset)`` that rank ``r`` of ``k`` holds of a dim of ``length`` (the arithmetic of
  local shapes, offsets and blocks in ``layout.py``);
* ``nests``: how it splits among other placements of the same dim (``ORDERED``: in the shard
  order, mesh dims left to right by default, like ``Shard``; ``LAST``: after every ordered split
  of its dim);
* ``rules_read``: whether sharding rules read it (else dispatch gathers it first: its mesh dim
  becomes ``Replicate``), and ``planned``: whether the collective planner moves it (else a
  redistribution goes by the block exchange, which sends each rank exactly the blocks it lacks);
* ``normalized(ndim, mesh_size)``: the checked placement with its dims wrapped;
* ``split_value(t, k, r)``: the local tensor of rank ``r`` of ``k`` from the whole value (or
  from the local tensor of the other placements), with no communication;
* ``local_grad()``: the placement of the gradient of ``to_local``'s result.

A new placement is one module with one class answering these, plus its line in ``__init__``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

ORDERED = "ordered"
LAST = "last"


class Placement:
    """Base class of the placements; mirrors ``torch.distributed.tensor.Placement``."""

    __slots__ = ("__weakref__",)  # torch.compile keeps weak references to graph constants

    nests: ClassVar[str | None] = None
    """How it splits its tensor dim with others on it: ``ORDERED``, ``LAST``, or None (no split)."""
    rules_read: ClassVar[bool] = True
    """Whether sharding rules read it; if not, dispatch gathers its mesh dim first."""
    planned: ClassVar[bool] = True
    """Whether the collective planner moves it; if not, redistribution exchanges blocks."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    def plain_op(self) -> str | None:
        """The reduction of its terms when they are parts of the value itself (a ``Partial``; a
        ``NormPartial``'s terms are norms of parts), else None."""
        return None

    def rescales_to(self, other: "Placement") -> bool:
        """Whether this placement's local values become ``other``'s by a local rescale (a
        ``Partial`` sum <-> avg), with no data moved."""
        return False

    def tensor_dim(self) -> int | None:
        """The tensor dim it splits, or None."""
        return None

    def on_dim(self, dim: int) -> "Placement":
        """This placement splitting tensor dim ``dim`` instead (an op moved its dim: a reduction
        dropped an earlier one); itself where it splits none.  The default rebuilds it with
        ``dim`` (its field of that name)."""
        return self if self.tensor_dim() is None else dataclasses.replace(self, dim=dim)  # type: ignore[type-var]

    def pieces(self, length: int, k: int, r: int) -> list[tuple[int, int]]:
        """``(size, offset)`` of each run that rank ``r`` of ``k`` holds of a dim of ``length``."""
        raise TypeError(f"{self!r} does not split a tensor dim")

    def global_length(self, local_length: int, k: int) -> int | None:
        """The length of its dim from one rank's piece, where the pieces are even (``from_local``
        without ``shape=`` and without gathering the sizes); None: the sizes must be gathered."""
        return local_length * k if self.tensor_dim() is not None else local_length

    def normalized(self, ndim: int, mesh_size: int | None = None) -> "Placement":
        """This placement checked for a tensor of ``ndim`` dims on a mesh dim of ``mesh_size``
        ranks (unknown: None), negative dims wrapped; raises naming what is wrong."""
        return self

    def split_value(self, t: torch.Tensor, k: int, r: int) -> torch.Tensor:
        """Rank ``r`` of ``k``'s local tensor from ``t``, the value its mesh dim holds whole (may be
        a view of ``t``): its ``pieces`` of its tensor dim laid end to end, or ``t`` whole."""
        d = self.tensor_dim()
        return t if d is None else narrow_runs(t, d, self.pieces(t.shape[d], k, r))

    @classmethod
    def from_text(cls, text: str) -> "Placement | None":
        """The placement spelled ``text`` (lower case, no spaces) in ``shardtensor plan``'s
        placements, or None when it is not this class's spelling (R, S and P are built in)."""
        return None

    def local_grad(self) -> "Placement":
        """The placement of the gradient a rank's local tensor receives (``to_local``'s backward
        default): where each rank's local gradient is dL/d(its local tensor), the placement that
        makes them the gradient of the global value.  A shard or a replica keeps its placement."""
        return self


def shard_dim(p: Placement) -> int | None:
    """The tensor dim ``p`` splits as ``Shard`` does (the torch.chunk rule, ordered), or None."""
    return p.tensor_dim() if p.is_shard() else None


def partial_op(p: Placement) -> str | None:
    """The reduction that combines ``p``'s terms when it is a partial (``"sum"``, ...), or None."""
    return getattr(p, "reduce_op", None) if p.is_partial() else None


def chunk(length: int, k: int, r: int) -> tuple[int, int]:
    """Size and offset of piece ``r`` when ``length`` is split into ``k`` torch.chunk pieces."""
    c = -(-length // k) if length else 0
    offset = min(c * r, length)
    return min(c, length - offset), offset


def chunk_sizes(length: int, k: int) -> list[int]:
    return [chunk(length, k, r)[0] for r in range(k)]


def wrap_dim(who: Placement, dim: int, ndim: int) -> int:
    """``dim`` wrapped into ``[0, ndim)``; raises naming the placement when out of range."""
    d = dim + ndim if dim < 0 else dim
    if not 0 <= d < ndim:
        raise ValueError(f"{who!r} is out of range for a tensor with {ndim} dims")
    return d


def check_int(who: str, name: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{who} {name} must be an int, got {v!r}")


def narrow_runs(t: torch.Tensor, dim: int, runs: list[tuple[int, int]]) -> torch.Tensor:
    """The runs of ``t`` along ``dim`` laid end to end (a view for one run)."""
    if len(runs) == 1:
        size, off = runs[0]
        return t.narrow(dim, off, size)
    return torch.cat([t.narrow(dim, o, s) for s, o in runs], dim=dim)


def unfake(x: Any) -> Any:
    """The real placement or mesh behind the stand-in torch.compile passes to code it runs
    eagerly after a graph break (a ``FakeScriptObject`` of an opaque value: ``compile.py``)."""
    if type(x).__name__ == "FakeScriptObject":
        return object.__getattribute__(x, "real_obj")
    return x
