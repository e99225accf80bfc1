"""``Partial(reduce_op)``: every rank holds a term; ``NormPartial(p)``: each holds a p-norm."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Placement
from .replicate import Replicate

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """Every rank holds a term; the value is ``reduce_op`` over the mesh dim's ranks."""

    __module__ = "shardtensor.placement"

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op == "prod":  # torch's spelling of the same reduction
            object.__setattr__(self, "reduce_op", "product")
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(f"Partial reduce_op must be one of {REDUCE_OPS}, got {self.reduce_op!r}")

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def plain_op(self) -> str | None:
        return self.reduce_op

    def rescales_to(self, other: Placement) -> bool:
        """A sum's terms are ``k`` times an average's (plain partials only, not norms)."""
        return {self.plain_op(), other.plain_op()} == {"sum", "avg"}

    def split_value(self, t: torch.Tensor, k: int, r: int) -> torch.Tensor:
        """Terms that reduce back to ``t`` exactly: the value on rank 0 and the identity elsewhere
        for a sum or product (-0.0 for floats: -0.0 + x == x bit for bit, signed zeros included);
        the value everywhere for avg, max and min."""
        op = self.reduce_op
        if op == "sum":
            if r == 0:
                return t.clone()
            if t.is_complex():
                return torch.full_like(t, complex(-0.0, -0.0))
            return torch.full_like(t, -0.0) if t.is_floating_point() else torch.zeros_like(t)
        if op == "product":
            return t.clone() if r == 0 else torch.ones_like(t)
        return t.clone()

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

    __module__ = "shardtensor.placement"

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

    def plain_op(self) -> str | None:
        return None

    def split_value(self, t: torch.Tensor, k: int, r: int) -> torch.Tensor:
        """Local norms whose p-norm is ``t``: each ``t / k^(1/p)`` (the value itself for +-inf)."""
        p = self.norm
        if p == 0:
            raise RuntimeError("Replicate -> NormPartial(0) is not defined (a count of non-zeros cannot be split)")
        if p in (float("inf"), float("-inf")):
            return t.clone()
        return t / (k ** (1.0 / p))

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
