"""The replicate fallback: an op without a sharding rule runs on whole tensors, visibly.

Every DTensor input is redistributed to ``Replicate`` (Partials reduced, shards gathered; the
collectives are recorded by ``CommTrace`` under ``fallback <op>``), the op runs on the whole
tensors on every rank, and its tensor outputs are ``Replicate``.  An argument the op writes
into takes the result back in its own placements (its shard of the whole result, no
communication).  The result is exact; the price is the gathered bytes, named in a warning
issued once per op.

Random ops run on one generator state every rank agrees on (``rng.draw``: one device's draw,
the same on every rank, so replicas agree) where they take a ``generator`` keyword; others never
fall back (each rank would draw its own numbers where a replicated tensor needs the same ones),
nor do ops on storage (``as_strided``, ``set_``, ``resize_``: the gathered copy's
strides are not the global tensor's): they keep raising.  ``strict_sharding()`` (per thread, so per simulated rank) and
the environment variable ``SHARDTENSOR_STRICT=1`` (the whole process) turn the fallback off:
ops without a rule raise ``UnsupportedOpError`` as they would without it.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import warnings
from types import FrameType
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import comm, rng
from ..aliasing import op_kind
from ..errors import ReplicateFallbackWarning
from ..implicit import implicit_allowed, plain_tensor_error
from ..pieces import with_strides
from ..placement import Replicate
from ..propagation.call import Call
from ..propagation.engine import one_mesh
from ..redistribute import redistribute_local
from ..spec import DTensorSpec, placements_text
from ..submesh import off_mesh_result
from ..tensor import DTensor

__all__ = ["strict_sharding", "fallback_allowed", "run_replicated", "replicate_plain", "wrap_replicated", "whole_local", "write_into",
           "check_plain",
           "ReplicateFallbackWarning"]


class _State(threading.local):
    strict = 0


_state = _State()
_warned: set[Any] = set()


@contextlib.contextmanager
def strict_sharding() -> Iterator[None]:
    """Inside the block an op without a sharding rule raises ``UnsupportedOpError`` instead of
    running on replicated inputs.  Per thread (so per simulated rank); nests.  For a whole
    process set ``SHARDTENSOR_STRICT=1``."""
    _state.strict += 1
    try:
        yield
    finally:
        _state.strict -= 1


_STORAGE_OPS = frozenset({"as_strided", "as_strided_", "set_", "resize_", "resize_as_", "_reshape_alias"})
"""Ops whose meaning is the storage behind a tensor (views of it, or changes to it): a gathered
copy cannot stand for the DTensor's memory, so they never run on it (``as_strided`` has a rule
that marks a gathered result as a copy; ``resize_`` and ``resize_as_`` a decomposition).  The
functional ``as_strided_copy`` and ``as_strided_scatter`` do fall back: the gathered copy has the
global strides (``whole_local``)."""


def fallback_allowed(func: Any) -> bool:
    """Whether ``func`` may run on replicated inputs here (not strict, not a random op, not an op
    on storage)."""
    if _state.strict or os.environ.get("SHARDTENSOR_STRICT", "") not in ("", "0"):
        return False
    name = func._schema.name.split("::")[-1]
    return (torch.Tag.nondeterministic_seeded not in func.tags or _seeded(func)) and name not in _STORAGE_OPS


def _seeded(func: Any) -> bool:
    """A random op that takes a ``generator`` argument (``normal``, ``poisson``, ``multinomial``,
    ``_standard_gamma`` ...): the fallback draws it with an agreed generator."""
    return torch.Tag.nondeterministic_seeded in func.tags and _generator_position(func) >= 0


def _generator_position(func: Any) -> int:
    """The schema position of ``func``'s ``generator`` argument, or -1."""
    return next((i for i, a in enumerate(func._schema.arguments) if a.name == "generator"), -1)


def run_replicated(func: Any, args: tuple, kwargs: dict, returns_self: bool) -> Any:
    """Run ``func`` on the whole tensors of its DTensor arguments; outputs are ``Replicate`` (a view
    op's are views of the gathered copy, not of its input: dispatch records them so)."""
    flat, treedef = tree_flatten((args, kwargs))
    dts = [a for a in flat if isinstance(a, DTensor)]
    mesh = one_mesh(func, [a._spec for a in dts])
    check_plain(func, flat)
    if mesh._coord is None:  # a rank outside the mesh runs nothing
        specs = [a._spec if isinstance(a, DTensor) else None for a in flat]
        out_specs = tree_map(lambda t: _replicated_spec(t, mesh) if isinstance(t, torch.Tensor) else None,
                             Call(func, flat, specs, treedef).out_meta)
        return off_mesh_result(func, out_specs, flat[0], dts[0]._local_tensor.device, dts[0].dtype, returns_self,
                               DTensor)
    with comm.scope(f"fallback {func}"):
        full = [whole_local(a) if isinstance(a, DTensor) else a for a in flat]
    _warn_once(func, dts)
    largs, lkwargs = tree_unflatten(full, treedef)
    if _seeded(func):  # every rank draws one device's numbers from one agreed generator state
        i, largs = _generator_position(func), list(largs)
        gen = largs[i] if i < len(largs) else lkwargs.pop("generator", None)

        def drawn(g: torch.Generator) -> Any:
            if i < len(largs):
                return func(*largs[:i], g, *largs[i + 1:], **lkwargs)
            return func(*largs, **lkwargs, generator=g)

        out = rng.draw(mesh, gen, dts[0]._local_tensor.device, drawn)
    else:
        out = func(*largs, **lkwargs)
    _write_back(func, args, kwargs, flat, full)
    if returns_self:
        return args[0]
    return tree_map(lambda t: wrap_replicated(t, mesh) if isinstance(t, torch.Tensor) else t, out)


def check_plain(func: Any, flat: list) -> None:
    """Plain tensors with dims among the arguments must be ones taken as replicated (``implicit``)."""
    for a in flat:
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim > 0 and not implicit_allowed(a):
            raise plain_tensor_error(func, a)


def whole_local(a: DTensor) -> torch.Tensor:
    """``a``'s whole tensor on this rank: its local tensor redistributed to all-``Replicate``,
    laid out with the global strides (ops such as ``as_strided_scatter`` read them)."""
    want = _replicated_spec_of(a._spec)
    t = a._local_tensor if want == a._spec else redistribute_local(a._local_tensor, a._spec, want)
    return with_strides(t, tuple(a._spec.shape), tuple(a._spec.stride))


def _replicated_spec_of(spec: DTensorSpec) -> DTensorSpec:
    return spec.with_placements([Replicate()] * spec.mesh.ndim)


def _write_back(func: Any, args: tuple, kwargs: dict, flat: list, full: list) -> None:
    """Arguments the op wrote into take their shard of the written whole tensor."""
    writes = op_kind(func)[1]
    if not writes:
        return
    schema = func._schema.arguments
    for i in writes:
        name = schema[i].name
        target = kwargs.get(name, args[i] if i < len(args) else None)
        if not isinstance(target, DTensor):
            continue
        written = full[next(k for k, a in enumerate(flat) if a is target)]
        write_into(target, written, _replicated_spec_of(target._spec))


def write_into(target: DTensor, result: torch.Tensor, spec: DTensorSpec) -> None:
    """``result``, laid out as ``spec``, written into ``target``'s own local tensor in ``target``'s
    placements: an argument an op writes into keeps its placements and memory, so its views see
    the write, as on one device."""
    if spec.placements != target._spec.placements or spec.shard_order != target._spec.shard_order:
        result = redistribute_local(result, spec, target._spec)
    if result is not target._local_tensor:  # a replicated whole may already be target's memory
        with torch.no_grad():
            target._local_tensor.copy_(result)


def replicate_plain(out: Any, args: tuple, kwargs: dict) -> Any:
    """New plain tensors in a result (of a decomposition, or of torch's C++ outside dispatch):
    built from the same shapes on every rank, so ``Replicate`` DTensors on the arguments' mesh.
    A plain argument written in place (``plain.add_(d)``, ``out=``) is returned as it is."""
    if isinstance(out, (tuple, list)):
        fixed = [replicate_plain(o, args, kwargs) for o in out]
        if all(a is b for a, b in zip(fixed, out)):
            return out
        return type(out)(*fixed) if hasattr(out, "_fields") else type(out)(fixed)
    if not isinstance(out, torch.Tensor) or isinstance(out, DTensor):
        return out
    flat = tree_flatten((args, kwargs))[0]
    if any(out is a for a in flat):
        return out
    return wrap_replicated(out, next(a._spec.mesh for a in flat if isinstance(a, DTensor)))


def wrap_replicated(t: torch.Tensor, mesh: Any) -> DTensor:
    """``t``, a whole tensor every rank holds alike, as a ``Replicate`` DTensor on ``mesh``."""
    return DTensor(t, _replicated_spec(t, mesh))


def _replicated_spec(t: torch.Tensor, mesh: Any) -> DTensorSpec:
    return DTensorSpec.build(mesh, [Replicate()] * mesh.ndim, t.shape, t.stride(), t.dtype)


def _warn_once(func: Any, dts: list[DTensor]) -> None:
    if func in _warned:
        return
    _warned.add(func)
    gathered = sum(math.prod(a._spec.shape) * a.dtype.itemsize for a in dts
                   if _replicated_spec_of(a._spec) != a._spec)
    pls = placements_text([a._spec for a in dts])
    warnings.warn(f"shardtensor: {func} has no sharding rule for inputs {pls}; it ran on replicated inputs, "
                  f"gathering {gathered} bytes on every rank (the result is exact; this warning is shown "
                  "once per op). To raise instead, use shardtensor.strict_sharding() or set SHARDTENSOR_STRICT=1.",
                  ReplicateFallbackWarning, stacklevel=_user_frame())


_SKIP = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


def _user_frame() -> int:
    """The ``stacklevel`` of the first frame outside shardtensor and torch (the user's line)."""
    f: FrameType | None = sys._getframe(2)
    level = 2
    while f is not None and f.f_code.co_filename.startswith(_SKIP):
        f, level = f.f_back, level + 1
    return level
