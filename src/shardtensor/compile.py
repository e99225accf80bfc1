"""What ``torch.compile`` needs from shardtensor.

A DTensor is a traceable wrapper subclass: ``__tensor_flatten__`` gives its local tensor and
its metadata, so AOTAutograd traces shardtensor's dispatch once on fake local tensors (the
placements are decided and the redistributions planned at compile time) and the compiled
graph holds only local ops and the collectives of ``comm.traced`` (which run the real
collectives when the graph runs).  Three things make that sound:

- The metadata is the spec *and the calling rank*.  A graph bakes in rank-dependent
  constants (which block of a replicated tensor this rank keeps, its padding); dynamo guards
  on the metadata, so a rank never runs a graph traced for another.  Processes each compile
  their own anyway; this matters for the simulated ranks of ``run_spmd``, which are threads
  sharing one dynamo cache.
- Dynamo never traces shardtensor's own Python: the package is on its skip list, so a call
  into the library's functions from compiled code (``from_local``, the parallel styles' hooks)
  is a graph break and runs eagerly, and dynamo never compiles the library's frames.
- A DTensor is a plain tensor to dynamo, so a method call on it (``redistribute``,
  ``full_tensor``, ``to_local``) becomes one node of the graph, which AOTAutograd traces
  through shardtensor's Python on fake tensors.  The node's arguments must be constants of the
  graph: placements and meshes are registered as torch's opaque value types (compared by
  ``__eq__``, written into graph code by ``__fx_repr__``), where torch has them without a base
  class (2.13 and newer).  On older torch a method call with placements stays a graph break.
- The graph's own ops on DTensors are traced through ``__torch_dispatch__`` by AOTAutograd;
  ``__coerce_tangent_metadata__`` says a Partial output's gradient arrives reduced.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

import torch

from .comm import current_transport
from .version import __version__

if TYPE_CHECKING:
    from .spec import DTensorSpec

__all__ = ["keep_dynamo_out", "methods_traced", "rank_key", "stable_hash"]

_TRACED: list[bool] = []  # whether placements and meshes are graph constants (set when dynamo loads)


def keep_dynamo_out() -> None:
    """Dynamo never compiles or inlines shardtensor's own frames: a call into the library
    from compiled code is a graph break (the call runs eagerly), at no cost per call.

    Importing dynamo takes over a second, so where it is not loaded yet this waits for
    its import (``torch.compile`` loads it) instead of loading it.
    """
    if "torch._dynamo" in sys.modules:
        _on_dynamo()
    elif not any(isinstance(f, _AfterDynamo) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamo())


def _on_dynamo() -> None:
    rules = getattr(sys.modules.get("torch._dynamo"), "trace_rules", None)
    if rules is not None and hasattr(rules, "add"):
        rules.add(__name__.split(".")[0])
    if not _TRACED:
        _TRACED.append(_register_constants())


def _register_constants() -> bool:
    """Placements and meshes as constants of compiled graphs (see the module docstring)."""
    from .mesh import DeviceMesh
    from .placement import NormPartial, Partial, Replicate, Shard, StridedShard
    try:
        from torch._library.opaque_object import MemberType, register_opaque_type
    except ImportError:
        return False
    placement = ("is_shard", "is_replicate", "is_partial", "__eq__", "__hash__")
    members = {Shard: placement + ("dim",), StridedShard: placement + ("dim", "split_factor"), Replicate: placement,
               Partial: placement + ("reduce_op",), NormPartial: placement + ("reduce_op", "norm"),
               DeviceMesh: ("ndim", "shape", "size", "get_rank", "get_local_rank", "get_coordinate", "mesh_dim_names",
                            "device_type", "__eq__", "__hash__")}
    for typ in ("constant", "value"):  # torch 2.15 renamed "value" to "constant"
        try:
            for cls, names in members.items():  # read at compile time on the real object
                register_opaque_type(cls, typ=typ, members=dict.fromkeys(names, MemberType.USE_REAL))
            return True
        except (AssertionError, TypeError, ValueError):  # an unknown kind, or a base class required (2.11)
            continue
    return False


def methods_traced() -> bool:
    """Whether ``redistribute(mesh, placements)`` on a DTensor traces into compiled graphs
    (loads dynamo)."""
    import torch._dynamo  # noqa: F401  (registers the constants)
    keep_dynamo_out()
    return bool(_TRACED and _TRACED[0])


class _AfterDynamo(importlib.abc.MetaPathFinder):
    """Runs ``_skip_package`` right after ``torch._dynamo`` is imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _on_dynamo()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def rank_key() -> int:
    """The calling rank, part of a DTensor's compile metadata (see the module docstring)."""
    return current_transport().rank


def stable_hash(spec: "DTensorSpec", local: torch.Tensor) -> str:
    """A digest of what a DTensor's traces depend on, the same in every process."""
    m = spec.mesh
    key = (__version__, m.device_type, m.shape, m._all, m.mesh_dim_names, repr(spec.placements), spec.shard_order,
           tuple(spec.shape), spec.stride, str(spec.dtype), rank_key(), tuple(local.shape), local.stride(),
           str(local.dtype), local.device.type)
    return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()
