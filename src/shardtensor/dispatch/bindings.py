"""Which callable runs an op on local tensors in the hit path: torch's Python binding of the op
where that binding provably calls it, else the op itself.

Calling an ``OpOverload`` (``aten.add.Tensor(a, b)``) parses its arguments through the JIT's
schema matcher; torch's generated Python bindings (``torch.add``, ``Tensor.view``) parse them in
C++ and call the same dispatcher entry, for about 0.5-1.5 us less per call -- a tenth of a cached
dispatch.  A binding is taken for one cache entry only after it has been seen, on that entry's own
local arguments, to dispatch exactly ``func`` first: the call runs under a dispatch mode that
records the first op to reach it and stops the call there (before any kernel runs or writes).
Bindings that decompose, pick another overload, reject the arguments or do not dispatch at all
keep the op, and so do ops that return a list of tensors (a binding returns a tuple there).
Later calls under the same entry have the same argument types and structure (the cache key
holds them), so they parse to the same overload.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["local_kernel"]

_HOMES = tuple(getattr(torch._C, name) for name in ("_VariableFunctions", "TensorBase", "_nn", "_linalg", "_special",
                                                     "_fft") if hasattr(torch._C, name))
"""Where torch's generated bindings live: ``torch.*`` functions, tensor methods, ``torch._C._nn``..."""


class _Dispatched(Exception):
    def __init__(self, func: Any) -> None:
        super().__init__()
        self.func = func


class _FirstOp(TorchDispatchMode):
    """Stops a call at the first op that reaches the dispatcher's Python key, naming it."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise _Dispatched(func)


def local_kernel(func: Any, args: list, kwargs: dict) -> Any:
    """A binding of torch that dispatches ``func`` when called as ``binding(*args, **kwargs)``
    (the local arguments of one hit-path call), else ``func``."""
    if func.namespace != "aten" or not _same_returns(func) or any(
            type(a) is not torch.Tensor for a in args if isinstance(a, torch.Tensor)):
        return func
    name = func._schema.name.split("::")[-1]
    for home in _HOMES:
        binding = getattr(home, name, None)
        if binding is None:
            continue
        try:
            with _FirstOp():
                binding(*args, **kwargs)
        except _Dispatched as d:
            if d.func is func:
                return binding
        except Exception:  # noqa: BLE001  (a binding that rejects these arguments is not taken)
            continue
    return func


def _same_returns(func: Any) -> bool:
    """Whether a binding returns what ``func`` returns: bindings give a tuple for a ``Tensor[]``
    (the op a list, which the dispatcher needs back), and the list they wrote for an in-place op
    that returns nothing (the hit path returns ``None`` for those itself)."""
    schema = func._schema
    if any(isinstance(r.type, torch.ListType) for r in schema.returns):
        return False
    return bool(schema.returns) or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
