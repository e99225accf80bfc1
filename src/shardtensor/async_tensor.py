"""A local tensor whose values are still on their way: the result of an asynchronous collective.

``AsyncLocalTensor`` knows its shape, dtype and device at once, so code can plan with it (build
specs, allocate, issue more collectives) while the communication runs.  The first torch op
that needs its values waits on the ``Work`` once and runs on the real tensor; every result is
a plain ``torch.Tensor``.  ``wait_tensor`` gives the real tensor explicitly.

Printing: ``str()`` / ``print()`` wait and show the values, as for any tensor; ``repr()`` never
blocks: while the collective is pending it says so (a debugger or a log line must not stall a
rank, or deadlock one whose peers have not issued yet), once done it shows the values.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .comm.base import Work
from .spec import contiguous_stride

__all__ = ["AsyncLocalTensor", "wait_tensor"]


class AsyncLocalTensor(torch.Tensor):
    """A tensor of known metadata whose data arrive when ``work`` finishes.

    Metadata queries (``shape``, ``dtype``, ``device``, ``stride()``, ``numel()``) never wait;
    ``stride()`` is that of a contiguous tensor.  Any op waits (once) and returns plain tensors.
    It never requires grad: it is a communication result, not a leaf of a graph.
    """

    _work: Work
    _real: torch.Tensor | None

    @staticmethod
    def __new__(cls, work: Work, shape: Sequence[int], dtype: torch.dtype,
                device: torch.device | str = "cpu") -> "AsyncLocalTensor":
        shape = tuple(int(n) for n in shape)
        r = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=contiguous_stride(shape), dtype=dtype, device=torch.device(device),
            requires_grad=False)
        r._work = work
        r._real = None
        return r

    def __init__(self, work: Work, shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()

    @classmethod
    def like(cls, work: Work, t: torch.Tensor) -> "AsyncLocalTensor":
        """An async tensor with ``t``'s shape, dtype and device (``t`` is not kept)."""
        return cls(work, t.shape, t.dtype, t.device)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:  # type: ignore[override]
        return func(*_unwrap(args), **_unwrap(kwargs or {}))

    def wait(self) -> torch.Tensor:
        """The real tensor (waits on the first call; the same object every time)."""
        if self._real is not None:
            return self._real
        real = self._work.wait()
        if real.shape != self.shape or real.dtype != self.dtype:
            raise RuntimeError(
                f"async collective produced {tuple(real.shape)} {real.dtype}, but its AsyncLocalTensor promised "
                f"{tuple(self.shape)} {self.dtype}")
        self._real = real
        return real

    def is_completed(self) -> bool:
        """True when ``wait()`` would not block on communication."""
        return self._work.is_completed()

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        if not self._work.is_completed():
            return (f"AsyncLocalTensor(pending, shape={tuple(self.shape)}, dtype={self.dtype}, "
                    f"device={self.device})")
        return f"AsyncLocalTensor({self.wait()!r})"

    def __str__(self) -> str:
        return str(self.wait())

    def __format__(self, spec: str) -> str:
        return format(self.wait(), spec)

    def tolist(self) -> Any:
        return self.wait().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.wait().numpy(force=force)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.wait().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self.wait().clone()


def _unwrap(x: Any) -> Any:
    if isinstance(x, AsyncLocalTensor):
        return x.wait()
    if type(x) is list or type(x) is tuple:
        return type(x)(_unwrap(v) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def wait_tensor(t: torch.Tensor) -> torch.Tensor:
    """The real tensor behind ``t`` if it is an ``AsyncLocalTensor`` (waiting if needed), else ``t``."""
    return t.wait() if isinstance(t, AsyncLocalTensor) else t
