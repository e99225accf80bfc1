"""The transport interface: the six collectives every backend provides over a group of ranks.

A group is a tuple of global ranks in group-rank order (the order of a mesh dim's
coordinates).  Stacked layouts keep the interface small: gathers return ``(k, *shape)``,
reduce-scatter and all-to-all take ``(k, *shape)``; block ``i`` belongs to group rank ``i``.

With ``async_op=True`` the four data collectives return a ``Work`` instead: the collective is
issued at once (its input is taken, its place in the group's order fixed) and ``wait()`` gives
exactly what the synchronous call returns, so communication can overlap with other work.
"""
from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, Protocol

import torch

Group = tuple[int, ...]

MeshDims = int | tuple[int, ...] | None
"""A mesh dim, a tuple of mesh dims (their flattened group, first dim most significant), or None (the mesh)."""

DEFAULT_TIMEOUT_S = float(os.environ.get("SHARDTENSOR_COMM_TIMEOUT", "120"))


def reduce_stack(stacked: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce a ``(k, ...)`` stack over dim 0 with one of the Partial reduce ops, keeping the dtype.

    Integers wrap as torch's own arithmetic does; a bool sum/avg/max is a logical or, a bool
    min/product a logical and (the arithmetic result cast back to bool).
    """
    dt = stacked.dtype
    if dt == torch.bool:
        if op in ("sum", "avg", "max"):
            return stacked.any(0)
        if op in ("min", "product"):
            return stacked.all(0)
    elif op == "sum":
        return stacked.sum(0, dtype=dt)
    elif op == "avg":
        return avg_divide(stacked.sum(0, dtype=dt), stacked.shape[0])
    elif op == "max":
        return stacked.amax(0)
    elif op == "min":
        return stacked.amin(0)
    elif op == "product":
        return stacked.prod(0, dtype=dt)
    raise ValueError(f"unknown reduce op {op!r}")


def avg_divide(total: torch.Tensor, k: int) -> torch.Tensor:
    """``total / k`` in ``total``'s dtype: true division for float and complex, floor for integers."""
    if total.dtype == torch.bool:
        return total
    if total.is_floating_point() or total.is_complex():
        return total / k
    return total.div(k, rounding_mode="floor")


class Work:
    """Handle of a collective in flight; ``wait()`` gives its result.

    ``wait_fn`` blocks until the collective is done and returns the raw result (a tensor, or
    whatever ``post`` turns into one); ``done_fn`` polls without blocking.  ``post`` (a local
    step such as a permutation or a division) runs once on the raw result at the first
    ``wait()``.  Later waits return the same tensor object (or re-raise the same error), so a
    handle can be shared and waited on from any thread.
    """

    __slots__ = ("_wait_fn", "_done_fn", "_post", "_lock", "_result", "_error", "_done")

    def __init__(self, wait_fn: Callable[[], Any], done_fn: Callable[[], bool] | None = None,
                 post: Callable[[Any], torch.Tensor] | None = None) -> None:
        self._wait_fn: Callable[[], Any] | None = wait_fn
        self._done_fn = done_fn
        self._post = post
        self._lock = threading.Lock()
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._done = False

    def wait(self) -> torch.Tensor:
        """Block until the collective finished; the result (the same object on every call)."""
        if not self._done:
            with self._lock:
                if not self._done:
                    try:
                        out = self._wait_fn()  # type: ignore[misc]  # None only once done
                        if self._post is not None:
                            out = self._post(out)
                        self._result = out
                    except Exception as e:  # noqa: BLE001 - kept and re-raised by every wait
                        self._error = e
                    self._done = True
                    self._wait_fn = self._done_fn = self._post = None  # drop buffers and closures
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def is_completed(self) -> bool:
        """True when ``wait()`` would not block on communication (it may still run ``post``)."""
        if self._done:
            return True
        done_fn = self._done_fn
        return bool(done_fn()) if done_fn is not None else False

    def then(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Work":
        """A handle whose result is ``fn(self.wait())``, computed once, at its own first wait."""
        return Work(self.wait, self.is_completed, fn)

    def chain(self, fn: Callable[[Any], Any]) -> "Work":
        """This handle with ``fn`` run on its result after its own ``post`` (``then`` without a
        second handle): only for a handle nobody else holds yet, such as one just issued."""
        if self._done:
            return self.then(fn)
        post = self._post
        self._post = fn if post is None else (lambda x: fn(post(x)))
        return self

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self._done else "pending"
        return f"<{type(self).__name__} {state}>"


class Completed(Work):
    """A ``Work`` finished at issue (a group of one, or a transport with nothing to overlap)."""

    __slots__ = ()

    def __init__(self, result: Any) -> None:  # done at birth: no closure, no lock taken
        self._wait_fn = self._done_fn = self._post = None
        self._lock = _NEVER_TAKEN
        self._result, self._error, self._done = result, None, True


_NEVER_TAKEN = threading.Lock()  # ``Completed``'s: ``wait`` takes the lock only while not done


class Transport(ABC):
    """One rank's view of a world of ranks; the only thing that moves data."""

    name: str = "transport"
    rank: int
    world_size: int
    world_id: int = 0
    """Tags this world's ``CommEvent``s (simulated worlds number themselves from 1)."""
    group_serial: int = -1
    """This world's part of the keys compiled code bakes in to find its process groups
    (``groups.py``): a number of its own in the process under torchrun; -1 where there are no
    groups to bake in, or where ranks are threads sharing dynamo's cache (found eagerly)."""
    owner: int = 0
    """The thread that started a simulated world (``threading.get_ident()``); 0 for torch.distributed."""

    def prepare_groups(self, groups: list[Group]) -> None:
        """Called by every rank with the same list when a mesh is built (collective)."""

    def process_group(self, group: Group) -> Any:
        """torch.distributed's ProcessGroup over ``group`` (what ``DeviceMesh.get_group`` returns)."""
        raise RuntimeError(
            f"the {self.name} world has no torch.distributed process groups, so DeviceMesh.get_group() has "
            "nothing to return; run under torchrun (gloo or NCCL), or use shardtensor.comm's collectives "
            "(all_reduce(t, 'sum', mesh, mesh_dim), all_gather, ...), which run on every world")

    @abstractmethod
    def all_gather(self, t: torch.Tensor, group: Group, *, async_op: bool = False) -> torch.Tensor | Work:
        """``(k, *t.shape)``: every member's ``t`` in group order (a ``Work`` if ``async_op``)."""

    @abstractmethod
    def all_reduce(self, t: torch.Tensor, op: str, group: Group, *, async_op: bool = False) -> torch.Tensor | Work:
        """A new tensor: ``op`` over every member's ``t`` (a ``Work`` if ``async_op``)."""

    @abstractmethod
    def reduce_scatter(self, t: torch.Tensor, op: str, group: Group, *,
                       async_op: bool = False) -> torch.Tensor | Work:
        """``t`` is ``(k, *s)``; ``op`` over every member's block of this rank (a ``Work`` if ``async_op``)."""

    @abstractmethod
    def all_to_all(self, t: torch.Tensor, group: Group, *, async_op: bool = False) -> torch.Tensor | Work:
        """``t`` is ``(k, *s)``; block ``i`` from group rank ``i`` (a ``Work`` if ``async_op``)."""

    @abstractmethod
    def all_to_all_v(self, sends: list[torch.Tensor], recv_shapes: list[tuple[int, ...]],
                     group: Group, *, async_op: bool = False) -> "list[torch.Tensor] | Work":
        """``sends[i]`` to group rank ``i``; returns what each member sent here (shapes known)."""

    @abstractmethod
    def broadcast(self, t: torch.Tensor, src: int, group: Group) -> torch.Tensor: ...

    @abstractmethod
    def send_recv(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        """Point-to-point by global rank: every ``(peer, t)`` of ``sends`` goes to ``peer``, every
        ``(peer, buf)`` of ``recvs`` is filled from ``peer`` (one message per peer and direction;
        the peer names this rank in its own call).  Returns when all are done."""

    @abstractmethod
    def barrier(self, group: Group) -> None: ...


class GroupSource(Protocol):
    """What a collective needs of a mesh (``DeviceMesh`` is one): the group of a mesh dim, and the
    calling rank's transport."""

    def group_ranks(self, mesh_dim: MeshDims) -> Group: ...

    @property
    def transport(self) -> Transport: ...
