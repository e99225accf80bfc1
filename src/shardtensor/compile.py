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
  into the library from compiled code (``redistribute``, ``from_local``, the parallel styles'
  hooks) is a graph break and runs eagerly, and dynamo never compiles the library's frames.
  Ops on DTensors and ``to_local()`` stay in the graph.
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

__all__ = ["keep_dynamo_out", "rank_key", "stable_hash"]


def keep_dynamo_out() -> None:
    """Dynamo never compiles or inlines shardtensor's own frames: a call into the library
    from compiled code is a graph break (the call runs eagerly), at no cost per call.

    Importing dynamo takes over a second, so where it is not loaded yet this waits for
    its import (``torch.compile`` loads it) instead of loading it.
    """
    if "torch._dynamo" in sys.modules:
        _skip_package()
    elif not any(isinstance(f, _AfterDynamo) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamo())


def _skip_package() -> None:
    rules = getattr(sys.modules.get("torch._dynamo"), "trace_rules", None)
    if rules is not None and hasattr(rules, "add"):
        rules.add(__name__.split(".")[0])


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
            _skip_package()

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
