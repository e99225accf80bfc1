"""Where eager time goes: per op, the time in dispatch, in deciding placements and in planning.

``DispatchProfile`` is a ``with`` block that times every DTensor dispatch (by swapping
``DTensor.__torch_dispatch__`` for a timed one while it is open, so closed it costs nothing) and
hears from the propagation and plan caches when they miss.  ``cache_stats()`` gives the caches'
counters.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from .. import observe
from ..propagation import cache_info as decision_cache_info
from ..redistribute import planner
from ..tensor import DTensor
from .trace import _format_seconds, _table

__all__ = ["DispatchProfile", "cache_stats"]


def cache_stats() -> dict[str, dict[str, int]]:
    """Counters of the two caches that keep eager dispatch cheap: ``decisions`` (propagation: an op
    and its input specs -> placements; hits of both lookup paths, misses, entries) and ``plans``
    (redistribution plans: hits, misses, entries, bound)."""
    p = planner.cache_info()
    return {"decisions": decision_cache_info(),
            "plans": {"hits": p.hits, "misses": p.misses, "size": p.currsize, "maxsize": p.maxsize or 0}}


class _Row:
    __slots__ = ("calls", "total", "own", "decided", "decide_s", "planned", "plan_s")

    def __init__(self) -> None:
        self.calls = self.decided = self.planned = 0
        self.total = self.own = self.decide_s = self.plan_s = 0.0


class DispatchProfile:
    """Per op: calls, total and own time in ``__torch_dispatch__`` (own: less nested dispatches of
    decompositions), rule evaluations (propagation cache misses) and plans made (plan cache
    misses) with their time.  Plans made outside any dispatch (``x.redistribute``) are listed
    under ``redistribute``.  Every simulated rank's dispatches count.  One profile at a time."""

    def __init__(self) -> None:
        self.rows: dict[str, _Row] = {}
        self.cache_before: dict | None = None
        self.cache_after: dict | None = None
        self._lock = threading.Lock()
        self._saved: Any = None

    def __enter__(self) -> "DispatchProfile":
        if observe.LISTENERS:
            raise RuntimeError("shardtensor: a DispatchProfile is already open; close it before opening another")
        self.cache_before = cache_stats()
        self._saved = DTensor.__dict__["__torch_dispatch__"]
        inner = self._saved.__func__
        profile = self

        def timed(cls, func, types, args=(), kwargs=None):
            stack = observe.running()
            frame = [func, 0.0]
            stack.append(frame)
            t0 = time.perf_counter()
            try:
                return inner(cls, func, types, args, kwargs)
            finally:
                dt = time.perf_counter() - t0
                stack.pop()
                if stack:
                    stack[-1][1] += dt
                profile._add(func, dt, dt - frame[1])

        DTensor.__torch_dispatch__ = classmethod(timed)  # type: ignore[method-assign,assignment]
        observe.LISTENERS.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        observe.LISTENERS.remove(self)
        DTensor.__torch_dispatch__ = self._saved  # type: ignore[method-assign]
        self.cache_after = cache_stats()

    def _row(self, op: Any) -> _Row:
        name = "redistribute" if op is None else str(op)
        row = self.rows.get(name)
        if row is None:
            row = self.rows[name] = _Row()
        return row

    def _add(self, op: Any, total: float, own: float) -> None:
        with self._lock:
            row = self._row(op)
            row.calls += 1
            row.total += total
            row.own += own

    def note(self, kind: str, op: Any, seconds: float) -> None:
        """A propagation (``decide``) or plan (``plan``) cache miss took ``seconds`` for ``op``."""
        with self._lock:
            row = self._row(op)
            if kind == "plan":
                row.planned += 1
                row.plan_s += seconds
            else:
                row.decided += 1
                row.decide_s += seconds

    def to_dict(self) -> dict[str, Any]:
        """Every row in seconds, and the caches' counters before and after the block."""
        return {"ops": {name: {k: getattr(r, k) for k in _Row.__slots__} for name, r in self.rows.items()},
                "cache_before": self.cache_before, "cache_after": self.cache_after}

    def summary(self, top: int = 20) -> str:
        """The ``top`` ops by total time, a total line, and what the caches did meanwhile."""
        rows = sorted(self.rows.items(), key=lambda kv: -kv[1].total)
        body = [[name, str(r.calls), _format_seconds(r.total), f"{r.own / max(r.calls, 1) * 1e6:.1f}",
                 str(r.decided), _format_seconds(r.decide_s), str(r.planned), _format_seconds(r.plan_s)]
                for name, r in rows[:top]]
        tot = _Row()
        for _, r in rows:
            tot.calls += r.calls
            tot.total += r.own  # nested dispatches counted once
            tot.own += r.own
            tot.decided += r.decided
            tot.decide_s += r.decide_s
            tot.planned += r.planned
            tot.plan_s += r.plan_s
        body.append([f"all {len(rows)} ops", str(tot.calls), _format_seconds(tot.total),
                     f"{tot.own / max(tot.calls, 1) * 1e6:.1f}", str(tot.decided), _format_seconds(tot.decide_s),
                     str(tot.planned), _format_seconds(tot.plan_s)])
        head = ["op", "calls", "dispatch", "own us/call", "decided", "deciding", "planned", "planning"]
        lines = _table(head, body)
        if self.cache_before is not None and self.cache_after is not None:
            for name in ("decisions", "plans"):
                a, b = self.cache_before[name], self.cache_after[name]
                lines.append(f"{name} cache: {b['hits'] - a['hits']} hits, {b['misses'] - a['misses']} misses, "
                             f"{b['size']} entries")
        return "\n".join(lines)

    def print_summary(self, top: int = 20) -> None:
        print(self.summary(top))

    def __str__(self) -> str:
        return self.summary()
