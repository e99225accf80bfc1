"""The floor of the overhead benchmarks: the least a ``__torch_dispatch__`` tensor subclass does per op.

``Floor`` wraps one local tensor.  Per op it unwraps its arguments (tensor lists too, for foreach
ops and fused optimizers), calls the op and wraps tensor results with ``_make_wrapper_subclass``;
an in-place op returns its first argument.  No specs, no caches, no checks; torch-function
handling is disabled (torch's C implementation), as PyTorch's DTensor does.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["Floor", "torch_function_off"]


class Floor(torch.Tensor):
    """A minimal wrapper subclass around ``inner``."""

    __slots__ = ("_inner",)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor, requires_grad: bool = False) -> "Floor":
        r = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                device=inner.device, requires_grad=requires_grad)
        r._inner = inner
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        local = [a._inner if type(a) is Floor else (_unwrap_list(a) if type(a) is list else a) for a in args]
        out = func(*local, **{k: _unwrap_list(v) if type(v) is list else v for k, v in kwargs.items()}
                   ) if kwargs else func(*local)
        if isinstance(out, torch.Tensor):
            return args[0] if local and out is local[0] else Floor(out)
        if isinstance(out, (list, tuple)):
            return type(out)(Floor(o) if isinstance(o, torch.Tensor) else o for o in out)
        return out


def _unwrap_list(xs: list) -> list:
    return [x._inner if type(x) is Floor else x for x in xs]


@contextlib.contextmanager
def torch_function_off() -> Iterator[None]:
    """Our DTensor with torch's C++ stand-in for ``__torch_function__`` (what PyTorch's DTensor and
    the floor use): the time our Python ``__torch_function__`` adds per op is ours hit minus the
    hit under this.  Benchmark-only: it drops the repairs that handler makes (docs/propagation.md)."""
    from shardtensor import DTensor

    mine = DTensor.__dict__["__torch_function__"]
    DTensor.__torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    try:
        yield
    finally:
        DTensor.__torch_function__ = mine  # type: ignore[method-assign]
