"""Which positions of a sequence each context-parallel rank holds, and what attention each pair sees.

A ``SeqLayout`` lists, per rank of the cp group, the global positions of its piece in the order the
rank holds them.  Nothing here requires a length to divide: pieces may differ by a position, and a
short document may leave a rank without any of it.

- ``contiguous``: piece ``r`` is ``torch.chunk``'s ``r``-th (a ``Shard`` of the sequence).
- ``head_tail``: the sequence cut into ``2P`` near-equal chunks; rank ``r`` holds chunks ``r`` and
  ``2P-1-r``, so under a causal mask every rank has a short and a long row band (torch's
  head-tail order when the length divides by ``2P``).
- ``per_document``: head-tail inside each packed document (lengths given), with the rounding
  leftovers rotated over the ranks document by document; attention stays inside documents.

The mask of a (query rank, key rank) pair follows from the positions: ``None`` when every pair
sees every key, a boolean ``(Lq, Lk)`` mask otherwise, ``False`` when nothing is visible (skipped).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["SeqLayout", "contiguous", "nested", "head_tail", "per_document"]


@dataclass(frozen=True, eq=False)
class SeqLayout:
    """Global positions held by each cp rank; ``documents``: each position's document id, or None."""

    positions: tuple[torch.Tensor, ...]
    documents: torch.Tensor | None = None
    kind: str = "contiguous"

    @property
    def length(self) -> int:
        return sum(int(p.numel()) for p in self.positions)

    @property
    def ranks(self) -> int:
        return len(self.positions)

    def count(self, rank: int) -> int:
        return int(self.positions[rank].numel())

    def order(self) -> torch.Tensor:
        """The permutation ``full[order]`` that lays the pieces end to end in rank order."""
        return torch.cat(self.positions)

    def restore(self) -> torch.Tensor:
        """Its inverse: ``pieces_end_to_end[restore]`` is the sequence in its own order."""
        return torch.argsort(self.order())

    def mask(self, q_rank: int, k_rank: int, causal: bool) -> torch.Tensor | None | bool:
        """What queries of ``q_rank`` see of keys of ``k_rank``: None (all), False (none), or a mask."""
        qp, kp = self.positions[q_rank], self.positions[k_rank]
        if qp.numel() == 0 or kp.numel() == 0:
            return False
        docs = self.documents
        if not causal and docs is None:
            return None
        if docs is None and int(kp.max()) <= int(qp.min()):
            return None
        if docs is None and int(kp.min()) > int(qp.max()):
            return False
        m = torch.ones(qp.numel(), kp.numel(), dtype=torch.bool)
        if causal:
            m &= kp.unsqueeze(0) <= qp.unsqueeze(1)
        if docs is not None:
            m &= docs[kp].unsqueeze(0) == docs[qp].unsqueeze(1)
        if bool(m.all()):
            return None
        return m if bool(m.any()) else False

    def work(self, causal: bool) -> list[int]:
        """Per rank: the (query, key) pairs its attention computes (what balancing evens out)."""
        out = []
        for q in range(self.ranks):
            total = 0
            for k in range(self.ranks):
                m = self.mask(q, k, causal)
                total += (self.count(q) * self.count(k) if m is None else
                          0 if m is False else int(m.sum()))  # type: ignore[union-attr]
            out.append(total)
        return out

    def __repr__(self) -> str:
        return f"SeqLayout({self.kind}, length={self.length}, counts={[self.count(r) for r in range(self.ranks)]})"


def _check(length: int, ranks: int) -> None:
    if not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be a non-negative int, got {length!r}")
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive int, got {ranks!r}")


def _chunks(piece: torch.Tensor, k: int) -> list[torch.Tensor]:
    """``torch.chunk``'s ``k`` pieces, empty ones added where it returns fewer."""
    out = list(piece.chunk(k)) if piece.numel() else []
    return out + [piece[:0]] * (k - len(out))


def contiguous(length: int, ranks: int) -> SeqLayout:
    """Rank ``r`` holds ``torch.chunk``'s ``r``-th piece (what ``Shard`` of the sequence holds)."""
    return nested(length, [ranks])


def nested(length: int, sizes: Sequence[int]) -> SeqLayout:
    """A sequence ``Shard`` on several mesh dims of these sizes (``torch.chunk`` dim by dim, the
    first outermost); pieces in row-major order of the mesh coordinates."""
    _check(length, max(1, math.prod(sizes)))
    pieces = [torch.arange(length)]
    for k in sizes:
        pieces = [p for piece in pieces for p in _chunks(piece, k)]
    return SeqLayout(tuple(pieces), None, "contiguous")


def _head_tail_pieces(start: int, length: int, ranks: int, shift: int = 0) -> list[torch.Tensor]:
    """Positions ``start..start+length`` cut into ``2*ranks`` near-equal chunks; rank ``r`` gets
    chunks ``(r+shift) % ranks`` and its mirror (leftover positions land on rotating ranks)."""
    chunks = torch.arange(start, start + length).tensor_split(2 * ranks)
    out = []
    for r in range(ranks):
        i = (r + shift) % ranks
        out.append(torch.cat([chunks[i], chunks[2 * ranks - 1 - i]]))
    return out


def head_tail(length: int, ranks: int) -> SeqLayout:
    """Chunks ``r`` and ``2P-1-r`` of ``2P`` near-equal chunks on rank ``r``: even causal work."""
    _check(length, ranks)
    return SeqLayout(tuple(_head_tail_pieces(0, length, ranks)), None, "head_tail")


def per_document(lengths: Sequence[int], ranks: int) -> SeqLayout:
    """Head-tail inside each document of a packed sequence; attention stays inside documents."""
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"document_lengths must be non-negative, got {lengths}")
    _check(sum(lengths), ranks)
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
    start = 0
    for j, n in enumerate(lengths):
        for r, piece in enumerate(_head_tail_pieces(start, n, ranks, shift=j)):
            per_rank[r].append(piece)
        start += n
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    return SeqLayout(tuple(torch.cat(p) if p else torch.zeros(0, dtype=torch.long) for p in per_rank),
                     docs, "per_document")
