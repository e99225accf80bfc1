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
  into the library from compiled code (``distribute_tensor``, ``fully_shard``'s hooks) is a
  graph break and runs eagerly, and dynamo never compiles the library's frames.  The one file
  it reads is ``parallel/hooks.py``: forward hooks that only pick values and call ``in_graph``
  functions, so a module with parallel styles is one graph.
- A DTensor is a plain tensor to dynamo, so a method call on it (``redistribute``,
  ``full_tensor``, ``to_local``) becomes one node of the graph, as does a call of an
  ``in_graph`` function (``from_local``, the styles' conversions); AOTAutograd traces each
  through shardtensor's Python on fake tensors.  The node's arguments must be constants of the
  graph: placements and meshes are registered as torch's opaque value types (compared by
  ``__eq__``, written into graph code by ``__fx_repr__``), where torch has them without a base
  class (2.13 and newer).  On older torch these calls stay graph breaks.
- The graph's own ops on DTensors are traced through ``__torch_dispatch__`` by AOTAutograd;
  ``__coerce_tangent_metadata__`` says a Partial output's gradient arrives reduced.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

import torch

from .comm import current_transport
from .version import __version__

if TYPE_CHECKING:
    from .spec import DTensorSpec

__all__ = ["in_graph", "keep_dynamo_out", "methods_traced", "rank_key", "stable_hash"]

_TRACED: list[bool] = []  # whether placements and meshes are graph constants (set when dynamo loads)
_IN_GRAPH: list[Callable] = []  # functions that compiled code calls as one node of its graph
_DYNAMO_READS = ("parallel/hooks.py",)
"""The package's files that dynamo traces: forward hooks whose bodies only call ``in_graph``
functions, so a compiled module with parallel styles is one graph."""


def in_graph(fn: Callable) -> Callable:
    """Mark ``fn`` (called with tensors, placements, meshes and plain values) as one node of a
    compiled graph: dynamo records the call, AOTAutograd traces it on fake tensors.  Where
    placements are not graph constants (torch 2.11) the call stays a graph break."""
    _IN_GRAPH.append(fn)
    if _TRACED and _TRACED[0]:
        torch.compiler.allow_in_graph(fn)
    return fn


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
    if _TRACED:
        return
    _skip_package(getattr(sys.modules.get("torch._dynamo"), "trace_rules", None))
    _TRACED.append(_register_constants())
    if _TRACED[0]:
        for fn in _IN_GRAPH:
            torch.compiler.allow_in_graph(fn)


def _skip_package(rules: Any) -> None:
    """Every file of the package on dynamo's skip list, except ``_DYNAMO_READS``."""
    if rules is None or not hasattr(rules, "add"):
        return
    root = os.path.dirname(os.path.abspath(__file__))
    skip_dirs, recompile = getattr(rules, "SKIP_DIRS", None), getattr(rules, "_recompile_re", None)
    if not isinstance(skip_dirs, list) or recompile is None:  # another dynamo: the whole package
        rules.add(__name__.split(".")[0])
        return
    read = {os.path.join(root, f) for f in _DYNAMO_READS}
    for path in sorted(os.listdir(root)):
        full = os.path.join(root, path)
        inside = [r for r in read if r.startswith(full + os.sep)]
        if not inside:
            skip_dirs.append(full + os.sep if os.path.isdir(full) else full)
        else:
            skip_dirs.extend(os.path.join(full, f) for f in sorted(os.listdir(full)) if os.path.join(full, f) not in read)
    recompile()


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
