"""Hooks for ``debug.DispatchProfile``: who listens, and what the dispatcher is running now.

Off (``LISTENERS`` empty), the only cost is one list check on the slow paths that report (a
propagation cache miss, a plan cache miss); the cache-hit path reports nothing, and the profile
times whole dispatches by swapping ``DTensor.__torch_dispatch__`` while it is open.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Protocol

__all__ = ["LISTENERS", "note", "running", "Listener", "deciding", "is_deciding"]


class Listener(Protocol):
    def note(self, kind: str, op: Any, seconds: float) -> None: ...


LISTENERS: list[Listener] = []
"""Open profiles; each gets every note."""

_running = threading.local()


def running() -> list:
    """This thread's stack of ``[op, seconds spent in nested dispatches]``, innermost last."""
    stack = getattr(_running, "stack", None)
    if stack is None:
        stack = _running.stack = []
    return stack


def note(kind: str, op: Any, seconds: float) -> None:
    """Report ``seconds`` spent in ``kind`` (``"decide"`` or ``"plan"``) for ``op`` (``None``: the
    op this thread is dispatching, if any)."""
    if op is None:
        stack = running()
        op = stack[-1][0] if stack else None
    for listener in LISTENERS:
        listener.note(kind, op, seconds)


_deciding = threading.local()


@contextmanager
def deciding() -> Iterator[None]:
    """Around a rule's evaluation: ops run inside work out shapes on meta tensors, not a rank's work
    (``auto.measure`` counts only the rest)."""
    depth = getattr(_deciding, "depth", 0)
    _deciding.depth = depth + 1
    try:
        yield
    finally:
        _deciding.depth = depth


def is_deciding() -> bool:
    return getattr(_deciding, "depth", 0) > 0
