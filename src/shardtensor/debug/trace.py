"""CommTrace: every collective inside a ``with`` block, with its bytes and who caused it.

The trace listens at the comm layer's single recording point, so it sees every collective
of both transports: in the simulated world the events of every rank (ranks are threads of
this process), under torch.distributed the events of this process's rank.  While a trace is
active, global ``nn.Module`` forward hooks push each module's name as a ``comm.scope``, so an
event's ``scope`` reads outermost first, e.g. ``("Block", "MLP", "aten.mm.default")``.

Outputs: ``summary()`` (tables by kind and by module/op), ``to_json(path)`` (every event) and
``chrome_trace(path)`` (Chrome trace-event JSON: one track per rank, load it in Perfetto or
``chrome://tracing``).
"""
from __future__ import annotations

import json
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch

from .. import comm
from ..comm import CommEvent

__all__ = ["CommTrace", "name_modules", "event_dict", "format_bytes"]

# -- module attribution ---------------------------------------------------------------------
# Global forward hooks are installed by the first active trace.  The pre-hook goes with the last
# trace; the post-hook stays until every scope it must close is closed (a module may still be
# running in another simulated rank), so no thread is left with a stale scope.

_hooks_lock = threading.Lock()
_hooks_users = 0
_pending = 0                              # scopes pushed by the pre-hook and not yet popped
_pre_handle: Any = None
_post_handle: Any = None
_module_labels: set[str] = set()          # labels pushed by the hooks (to tell modules from ops)
_names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_tls = threading.local()                  # per thread: stack of (module id, scope context manager)


def name_modules(root: torch.nn.Module, prefix: str = "") -> None:
    """Attribute collectives to qualified names (``layers.0.mlp``) of ``root``'s submodules.

    Without it a module is labelled by its class name.  The root itself keeps its class name
    unless ``prefix`` is given.  In the simulated world call it on every rank (each rank has
    its own module objects).
    """
    for name, m in root.named_modules(prefix=prefix):
        if name:
            _names[m] = name


def _label(module: torch.nn.Module) -> str:
    try:
        name = _names.get(module)
    except TypeError:  # pragma: no cover - unhashable module
        name = None
    return name if name else type(module).__name__


def _stack() -> list:
    s = getattr(_tls, "stack", None)
    if s is None:
        s = _tls.stack = []
    return s


def _pre_hook(module: torch.nn.Module, args: Any) -> None:
    global _pending
    label = _label(module)
    _module_labels.add(label)
    cm = comm.scope(label)
    cm.__enter__()
    _stack().append((id(module), cm))
    with _hooks_lock:
        _pending += 1


def _pop(n_until: Callable[[int], bool]) -> None:
    """Close this thread's scopes from the top until ``n_until(module id)`` is true."""
    global _pending
    stack = _stack()
    popped = 0
    while stack:
        k, cm = stack.pop()
        popped += 1
        try:
            cm.__exit__(None, None, None)
        except IndexError:  # pragma: no cover - scope stack already unwound
            pass
        if n_until(k):
            break
    with _hooks_lock:
        _pending -= popped
        _maybe_remove_post_hook()


def _post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    key = id(module)
    if any(k == key for k, _ in _stack()):
        # Pop down to this module: entries above it belong to children whose forward raised
        # without closing their scope (an exception caught in between), so they are stale.
        _pop(lambda k: k == key)
    else:
        with _hooks_lock:
            _maybe_remove_post_hook()


def _maybe_remove_post_hook() -> None:
    global _post_handle
    if _hooks_users == 0 and _pending <= 0 and _post_handle is not None:
        _post_handle.remove()
        _post_handle = None


def _install_hooks() -> None:
    global _hooks_users, _pre_handle, _post_handle
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    with _hooks_lock:
        _hooks_users += 1
        if _post_handle is None:
            _post_handle = register_module_forward_hook(_post_hook, always_call=True)
        if _pre_handle is None:
            _pre_handle = register_module_forward_pre_hook(_pre_hook)


def _remove_hooks() -> None:
    global _hooks_users, _pre_handle
    with _hooks_lock:
        _hooks_users -= 1
        last = _hooks_users == 0
        if last and _pre_handle is not None:
            _pre_handle.remove()
            _pre_handle = None
    if last:
        # scopes this thread still holds (a forward that raised past the trace) end with it
        _pop(lambda k: False)


# -- formatting helpers ---------------------------------------------------------------------

def format_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB`` (exact integers below 1 KiB)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def event_dict(ev: CommEvent, t0: float = 0.0, module_labels: Iterable[str] = ()) -> dict[str, Any]:
    """A JSON-ready dict of one event (``start`` relative to ``t0``, in seconds)."""
    labels = set(module_labels)
    return {
        "kind": ev.kind,
        "rank": ev.rank,
        "mesh_dim": ev.mesh_dim,
        "group": list(ev.group),
        "group_size": ev.group_size,
        "bytes_sent": ev.bytes_sent,
        "bytes_received": ev.bytes_received,
        "dtype": _dtype_name(ev.dtype),
        "shape": list(ev.shape),
        "seconds": ev.seconds,
        "start": ev.start - t0,
        "backend": ev.backend,
        "scope": list(ev.scope),
        "module": "/".join(s for s in ev.scope if s in labels),
    }


# -- the trace ------------------------------------------------------------------------------

_KEYS: dict[str, Callable[["CommTrace", CommEvent], Any]] = {
    "kind": lambda t, e: e.kind,
    "module": lambda t, e: " / ".join(e.scope) if e.scope else "(no scope)",
    "scope": lambda t, e: " / ".join(e.scope) if e.scope else "(no scope)",
    "op": lambda t, e: next((s for s in reversed(e.scope) if s not in t.module_labels), "(no op)"),
    "modules": lambda t, e: "/".join(s for s in e.scope if s in t.module_labels) or "(no module)",
    "rank": lambda t, e: e.rank,
    "mesh_dim": lambda t, e: "-" if e.mesh_dim is None else (
        "+".join(map(str, e.mesh_dim)) if isinstance(e.mesh_dim, tuple) else e.mesh_dim),
    "group_size": lambda t, e: e.group_size,
    "dtype": lambda t, e: _dtype_name(e.dtype),
    "backend": lambda t, e: e.backend,
}

_NUMERIC = ("rank", "mesh_dim", "group_size")


def _num_key(x: Any) -> tuple:
    """Sort key of a numeric column: ``-`` first, then ints; a flattened ``0+1`` after its first dim."""
    if x == "-":
        return (-1,)
    if isinstance(x, str):
        return tuple(int(v) for v in x.split("+"))
    return (x,)
_TITLES = {"module": "module / op", "scope": "module / op", "modules": "module", "op": "op",
           "mesh_dim": "mesh dim", "group_size": "group"}


class CommTrace:
    """Record every collective inside ``with CommTrace() as t:``.

    ``rank``: keep only that rank's events (default: every rank this process sees).
    ``world``: keep only that world's events (default: the caller's simulated world when the
    trace is opened inside ``run_spmd``, else the worlds started from the thread that opened it,
    and torch.distributed's; each event carries its ``world``).  ``all_threads=True``: the worlds
    of every thread of the process.
    ``modules``: attribute collectives to the ``nn.Module`` whose forward caused them
    (global forward hooks while the trace is active); pass a module to label its submodules
    by qualified name (see ``name_modules``).
    """

    def __init__(self, rank: int | None = None, modules: bool | torch.nn.Module = True,
                 world: int | None = None, all_threads: bool = False) -> None:
        self.rank = rank
        self.world, self.owner = comm.recorded_worlds(world, all_threads)
        self._modules = modules is not False and modules is not None
        if isinstance(modules, torch.nn.Module):
            name_modules(modules)
        self._events: list[CommEvent] = []
        self._lock = threading.Lock()
        self._active = False
        self.t0: float = time.time()
        self.t1: float | None = None

    # -- recording --------------------------------------------------------------------------
    def _on(self, ev: CommEvent) -> None:
        if not comm.selected(ev, self.rank, self.world, self.owner):
            return
        with self._lock:
            self._events.append(ev)

    def __enter__(self) -> "CommTrace":
        if self._active:
            raise RuntimeError("this CommTrace is already active")
        self._active = True
        self.t0 = time.time()
        self.t1 = None
        if self._modules:
            _install_hooks()
        comm.add_listener(self._on)
        return self

    def __exit__(self, *exc: object) -> None:
        comm.remove_listener(self._on)
        if self._modules:
            _remove_hooks()
        self._active = False
        self.t1 = time.time()

    def clear(self) -> None:
        with self._lock:
            self._events.clear()

    @property
    def events(self) -> list[CommEvent]:
        """The recorded events, in the order they were reported (a copy)."""
        with self._lock:
            return list(self._events)

    @property
    def module_labels(self) -> frozenset[str]:
        """Scope labels that name modules (the rest name ops or ``redistribute``)."""
        return frozenset(_module_labels)

    def of_rank(self, rank: int) -> list[CommEvent]:
        return [e for e in self.events if e.rank == rank]

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    def totals(self) -> dict[str, Any]:
        """Events, bytes sent and received and time, summed over every recorded event."""
        evs = self.events
        return {
            "events": len(evs),
            "bytes_sent": sum(e.bytes_sent for e in evs),
            "bytes_received": sum(e.bytes_received for e in evs),
            "seconds": sum(e.seconds for e in evs),
        }

    # -- tables -----------------------------------------------------------------------------
    def group(self, key: str | Sequence[str]) -> dict[tuple, dict[str, Any]]:
        """Aggregate by one key or a tuple of keys: ``{values: {count, ranks, bytes..., seconds}}``."""
        keys = (key,) if isinstance(key, str) else tuple(key)
        for k in keys:
            if k not in _KEYS:
                raise ValueError(f"unknown summary key {k!r}; choose from {sorted(_KEYS)}")
        out: dict[tuple, dict[str, Any]] = {}
        for e in self.events:
            v = tuple(_KEYS[k](self, e) for k in keys)
            row = out.setdefault(v, {"count": 0, "ranks": set(), "bytes_sent": 0, "bytes_received": 0, "seconds": 0.0})
            row["count"] += 1
            row["ranks"].add(e.rank)
            row["bytes_sent"] += e.bytes_sent
            row["bytes_received"] += e.bytes_received
            row["seconds"] += e.seconds
        return out

    def summary(self, by: Sequence[str | Sequence[str]] = ("kind", "module")) -> str:
        """Printable tables: one per entry of ``by`` (a key, or a tuple of keys grouped together).

        Keys: ``kind``, ``module`` (the scope path: modules, then the op or ``redistribute``),
        ``modules`` (module path only), ``op``, ``rank``, ``mesh_dim``, ``group_size``,
        ``dtype``, ``backend``.  Counts are per-rank events: a collective over ``k`` simulated
        ranks counts ``k`` times; bytes are summed over those ranks.
        """
        if isinstance(by, str):
            by = (by,)
        t = self.totals()
        ranks = self.ranks
        lines = [f"CommTrace: {t['events']} events on {len(ranks)} rank{'s' if len(ranks) != 1 else ''}"
                 f"{' ' + _ranks_text(ranks) if ranks else ''}, sent {format_bytes(t['bytes_sent'])}, "
                 f"received {format_bytes(t['bytes_received'])}, time {_format_seconds(t['seconds'])}"]
        for key in by:
            keys = (key,) if isinstance(key, str) else tuple(key)
            groups = self.group(keys)
            head = [" / ".join(_TITLES.get(k, k) for k in keys), "count", "ranks", "sent", "received", "time"]
            rows = []
            if any(k in _NUMERIC for k in keys):
                order = sorted(groups.items(), key=lambda kv: tuple((str(x),) if k not in _NUMERIC else _num_key(x)
                                                                   for k, x in zip(keys, kv[0])))
            else:
                order = sorted(groups.items(), key=lambda kv: (-kv[1]["bytes_sent"], -kv[1]["count"], str(kv[0])))
            for v, r in order:
                rows.append([" | ".join(str(x) for x in v), str(r["count"]), str(len(r["ranks"])),
                             format_bytes(r["bytes_sent"]), format_bytes(r["bytes_received"]),
                             _format_seconds(r["seconds"])])
            rows.append(["total", str(t["events"]), str(len(ranks)), format_bytes(t["bytes_sent"]),
                         format_bytes(t["bytes_received"]), _format_seconds(t["seconds"])])
            lines.append("")
            lines.extend(_table(head, rows))
        return "\n".join(lines)

    def print_summary(self, by: Sequence[str | Sequence[str]] = ("kind", "module")) -> None:
        print(self.summary(by))

    def __str__(self) -> str:
        return self.summary()

    # -- files ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        labels = self.module_labels
        by_kind = {k[0]: {**v, "ranks": sorted(v["ranks"])} for k, v in self.group("kind").items()}
        return {
            "format": "shardtensor.CommTrace/1",
            "t0": self.t0,
            "pid": os.getpid(),
            "totals": self.totals(),
            "by_kind": by_kind,
            "events": [event_dict(e, self.t0, labels) for e in self.events],
        }

    def to_json(self, path: str | os.PathLike) -> str:
        """Write every event (and totals by kind) as JSON; returns the path."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        return os.fspath(path)

    def chrome_events(self) -> list[dict[str, Any]]:
        """Chrome trace events: one complete ("X") event per collective, tid = rank."""
        out: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                                      "args": {"name": "shardtensor collectives"}}]
        for r in self.ranks:
            out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
        labels = self.module_labels
        for e in sorted(self.events, key=lambda e: (e.start, e.rank)):
            scope = " / ".join(e.scope)
            out.append({
                "name": e.kind if not e.scope else f"{e.kind} ({e.scope[-1]})",
                "cat": "comm",
                "ph": "X",
                "pid": 0,
                "tid": e.rank,
                "ts": round((e.start - self.t0) * 1e6, 3),
                "dur": round(e.seconds * 1e6, 3),
                "args": {
                    "kind": e.kind,
                    "bytes_sent": e.bytes_sent,
                    "bytes_received": e.bytes_received,
                    "group": list(e.group),
                    "group_size": e.group_size,
                    "mesh_dim": e.mesh_dim,
                    "dtype": _dtype_name(e.dtype),
                    "shape": list(e.shape),
                    "scope": scope,
                    "module": "/".join(s for s in e.scope if s in labels),
                    "backend": e.backend,
                },
            })
        return out

    def chrome_trace(self, path: str | os.PathLike) -> str:
        """Write Chrome trace-event JSON (pid 0, one thread per rank, times in microseconds)."""
        with open(path, "w") as f:
            json.dump({"traceEvents": self.chrome_events(), "displayTimeUnit": "ms"}, f)
        return os.fspath(path)


def _ranks_text(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"({ranks[0]}-{ranks[-1]})"
    return "(" + ",".join(map(str, ranks)) + ")"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [fmt(head), rule, *[fmt(r) for r in rows[:-1]], rule, fmt(rows[-1])]
