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

What a (query rank, key rank) pair computes follows from the positions: each rank's piece falls
into runs of consecutive positions (split at document ends), and each pair of runs is skipped
(no query sees a key), full (every query sees every key), causal (the same run: the lower
triangle) or, rarely, masked by an explicit boolean mask (``Pair``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["SeqLayout", "Pair", "contiguous", "nested", "split_order", "head_tail", "per_document"]


@dataclass(frozen=True)
class Pair:
    """Queries ``qs`` (local rows) against keys ``ks``: all visible, the causal triangle, or ``mask``."""

    qs: slice
    ks: slice
    causal: bool = False
    mask: torch.Tensor | None = None

    @property
    def work(self) -> int:
        n, m = self.qs.stop - self.qs.start, self.ks.stop - self.ks.start
        if self.mask is not None:
            return int(self.mask.sum())
        return n * (n + 1) // 2 if self.causal else n * m


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

    def runs(self, rank: int) -> list[tuple[int, int, int]]:
        """(local start, length, first global position) of each run of consecutive positions of
        one document in ``rank``'s piece."""
        p = self.positions[rank]
        if p.numel() == 0:
            return []
        cut = p[1:] != p[:-1] + 1
        if self.documents is not None:
            d = self.documents[p]
            cut |= d[1:] != d[:-1]
        starts = [0] + (torch.nonzero(cut).flatten() + 1).tolist() + [p.numel()]
        return [(a, b - a, int(p[a])) for a, b in zip(starts[:-1], starts[1:])]

    def pairs(self, q_rank: int, k_rank: int, causal: bool) -> list[Pair]:
        """What queries of ``q_rank`` compute against keys of ``k_rank`` (skipped runs left out)."""
        out = []
        for qa, qn, qp in self.runs(q_rank):
            for ka, kn, kp in self.runs(k_rank):
                if self.documents is not None and int(self.documents[qp]) != int(self.documents[kp]):
                    continue
                pair = _pair(slice(qa, qa + qn), slice(ka, ka + kn), qp, kp, causal)
                if pair is not None:
                    out.append(pair)
        return out

    def work(self, causal: bool) -> list[int]:
        """Per rank: the (query, key) pairs its attention computes (what balancing evens out)."""
        return [sum(p.work for k in range(self.ranks) for p in self.pairs(q, k, causal)) for q in range(self.ranks)]

    def __repr__(self) -> str:
        return f"SeqLayout({self.kind}, length={self.length}, counts={[self.count(r) for r in range(self.ranks)]})"


def _pair(qs: slice, ks: slice, qp: int, kp: int, causal: bool) -> Pair | None:
    """Runs of global positions ``qp..`` (queries) and ``kp..`` (keys): what they compute."""
    qn, kn = qs.stop - qs.start, ks.stop - ks.start
    if not causal or kp + kn - 1 <= qp:
        return Pair(qs, ks)
    if kp > qp + qn - 1:
        return None
    if kp == qp and kn == qn:
        return Pair(qs, ks, causal=True)
    mask = torch.arange(kp, kp + kn).unsqueeze(0) <= torch.arange(qp, qp + qn).unsqueeze(1)
    return Pair(qs, ks, mask=mask)


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


def split_order(order: torch.Tensor, ranks: int, kind: str) -> SeqLayout:
    """Positions listed in ``order`` (a permutation of the sequence) cut by ``torch.chunk`` into
    one piece per rank: what sharding a permuted buffer gives."""
    return SeqLayout(tuple(_chunks(order, ranks)), None, kind)


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
