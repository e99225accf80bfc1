"""Where a ``fully_shard`` group's parameters lie in the flat block each dp rank sends.

One all-gather serves a group and one reduce-scatter its gradients: every rank sends a flat
block of the same length.  Even (``Shard(0)``) parameters come first, each at the same offset
on every rank with its padded size (``ceil(s / W)`` rows), so the gathered ``(W, total)`` stack
splits into them with one ``split_with_sizes_copy`` and gradients pack with one ``chunk_cat``.
Ragged (``RaggedShard(0, ...)``) parameters follow, rank ``q``'s pieces end to end; every
rank's block is as long as the longest, the rest zeros.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch

from ..kernels import chunk_cat, split_with_sizes_copy
from .param import FSDPParam

__all__ = ["Packing"]


_OWN_CHUNK_CAT_BYTES = 1 << 24
"""Gradient packs from this size on (CPU) use ``kernels.chunk_cat``, whose copies run at memcpy
speed; below it ``torch._chunk_cat`` costs less per call (``benchmarks/README.md``, hooks.py section)."""


class Packing:
    """Where each of ``items`` lies in every dp rank's block of a flat all-gather or
    reduce-scatter (sizes in units of ``unit(i)`` per element).  Even (``Shard(0)``) parameters
    come first, each at the same offset on every rank with its padded size, so the stack splits
    into them in one ``split_with_sizes_copy``; then the ragged ones, rank ``q``'s pieces end to
    end (``runs``: each rank's ``(start, length)``); every block is as long as the longest."""

    def __init__(self, params: Sequence[FSDPParam], items: Sequence[int], unit: Callable[[int], int], world: int,
                 rank: int) -> None:
        self.items = sorted(items, key=lambda i: params[i].ragged)  # stable: the even ones first, in order
        self.n_even = sum(not params[i].ragged for i in self.items)
        self.even_sizes = [params[i].padded_numel * unit(i) for i in self.items[:self.n_even]]
        self.even_total = sum(self.even_sizes)
        ends = [self.even_total] * world
        self.runs: list[list[tuple[int, int]]] = []
        self.ragged = [params[i] for i in self.items[self.n_even:]]
        for i in self.items[self.n_even:]:
            p, runs = params[i], []
            for q, (rows, _) in enumerate(p.runs):
                runs.append((ends[q], rows * p.row_numel * unit(i)))
                ends[q] += runs[-1][1]
            self.runs.append(runs)
        self.total = max(ends)
        self.ends = ends  # where each rank's ragged pieces end (zeros after, up to ``total``)
        self.sizes = self.even_sizes + [r[rank][1] for r in self.runs]  # this rank's share of each item
        self.starts = list(itertools.accumulate(self.even_sizes[:-1], initial=0))[:self.n_even] + \
            [r[rank][0] for r in self.runs]
        self.world = world

    def copy_out(self, stack: torch.Tensor, dst: list[torch.Tensor]) -> None:
        """The ``(W, total)`` stack into the unsharded buffers ``dst`` (``(W, share)`` views of the
        even ones, flat ragged ones)."""
        ne = self.n_even
        if ne == len(dst):  # no ragged parameter: one split of the whole stack
            if stack.is_cuda:
                split_with_sizes_copy(stack, self.even_sizes, dim=1, out=dst)  # one launch (Triton)
            else:
                torch.split_with_sizes_copy(stack, self.even_sizes, dim=1, out=dst)
            return
        if ne:
            torch.split_with_sizes_copy(stack.narrow(1, 0, self.even_total), self.even_sizes, dim=1, out=dst[:ne])
        for j, out in enumerate(dst[ne:]):
            torch.cat(self.gathered(stack, j), out=out)

    def gathered(self, stack: torch.Tensor, j: int) -> list[torch.Tensor]:
        """Ragged parameter ``j``'s pieces in the ``(W, total)`` stack, in rank order (they make it)."""
        return [stack[q].narrow(0, a, n) for q, (a, n) in enumerate(self.runs[j])]

    def rank_parts(self, q: int, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Rank ``q``'s rows of each ragged parameter's unsharded gradient (``grads``, in order), flat."""
        return [g.narrow(0, p.runs[q][1], p.runs[q][0]).reshape(-1) for p, g in zip(self.ragged, grads)]

    def pack(self, grads: list[torch.Tensor], flat: torch.Tensor) -> None:
        """The unsharded ``grads`` (of ``items``, in order) into the ``(W, total)`` reduce-scatter
        input: rank ``q``'s block holds its rows of each."""
        ne, W = self.n_even, self.world
        if ne:
            out = flat if self.even_total == self.total else flat.new_empty((W, self.even_total))
            even = grads if ne == len(grads) else grads[:ne]
            if out.is_cuda or out.numel() * out.element_size() >= _OWN_CHUNK_CAT_BYTES:
                chunk_cat(even, 0, W, out=out)  # CUDA: one Triton launch; CPU: memcpy-speed copies
            else:
                torch._chunk_cat(even, 0, W, out=out)  # small: torch's fixed cost is lower
            if out is not flat:
                flat.narrow(1, 0, self.even_total).copy_(out)
        for q in range(W if self.ragged else 0):
            end = self.ends[q]
            torch.cat(self.rank_parts(q, grads[ne:]), out=flat[q].narrow(0, self.even_total, end - self.even_total))
            flat[q].narrow(0, end, self.total - end).zero_()
