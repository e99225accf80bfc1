"""``CommDebugMode``: torch's collective counter, over ``CommTrace``.

Code written for torch's DTensor counts collectives with ``CommDebugMode`` and reads the counts
by torch's functional-collective ops (``torch.ops.c10d_functional.all_reduce``, ...).  This one
counts the calling rank's collectives under the same keys.  shardtensor plans its own
collectives (often fewer, sometimes of another kind), so counts can differ from torch's DTensor
running the same code; ``CommTrace`` shows what ran and why.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from .. import comm
from .trace import CommTrace

_KEYS = {"all_gather": "all_gather_into_tensor", "all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter_tensor",
         "all_to_all": "all_to_all_single", "broadcast": "broadcast"}
"""Our collective kinds -> the names of torch's functional collectives (barriers are not counted)."""


def _key(kind: str) -> Any:
    """torch's op packet for ``kind``: ``c10d_functional``'s, as torch's counter reports them,
    where torch registered it (it does when ``torch.distributed.tensor`` is imported), else the
    native ``_c10d_functional`` one."""
    name = _KEYS[kind]
    for namespace in (torch.ops.c10d_functional, torch.ops._c10d_functional):
        try:
            return getattr(namespace, name)
        except AttributeError:
            continue
    return name


class CommDebugMode:
    """``with CommDebugMode() as mode:`` counts this rank's collectives; ``get_comm_counts()``
    maps torch's functional-collective ops to counts, ``get_total_counts()`` sums them."""

    def __init__(self) -> None:
        self._trace: CommTrace | None = None

    def __enter__(self) -> "CommDebugMode":
        self._trace = CommTrace(rank=comm.current_transport().rank, modules=False)
        self._trace.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._trace is not None
        self._trace.__exit__(*exc)

    @property
    def comm_counts(self) -> dict[Any, int]:
        events = self._trace.events if self._trace is not None else []
        return dict(Counter(_key(e.kind) for e in events if e.kind in _KEYS))

    def get_comm_counts(self) -> dict[Any, int]:
        return self.comm_counts

    def get_total_counts(self) -> int:
        return sum(self.comm_counts.values())

    @property
    def trace(self) -> CommTrace | None:
        """The underlying ``CommTrace`` (bytes, groups, mesh dims of every collective)."""
        return self._trace
