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
  into the library from compiled code (``distribute_tensor``) is a graph break and runs
  eagerly, and dynamo never compiles the library's frames.  The files it reads are the hooks of
  ``_DYNAMO_READS`` (the parallel styles', ``fully_shard``'s): they only pick values and call
  ``in_graph`` functions, so a module with parallel styles or FSDP is one graph.  (The example models of
  ``shardtensor.examples`` are user code: dynamo traces them as it traces any model.)
- A DTensor is a plain tensor to dynamo, so a method call on it (``redistribute``,
  ``full_tensor``, ``to_local``) becomes one node of the graph, as does a call of an
  ``in_graph`` function (``from_local``, the styles' conversions); AOTAutograd traces each
  through shardtensor's Python on fake tensors.  The node's arguments must be constants of the
  graph: placements and meshes are registered as torch's opaque value types (compared by
  ``__eq__``, written into graph code by ``__fx_repr__``), where torch has them without a base
  class (2.13 and newer).  On older torch these calls stay graph breaks.  Such a node traced on
  one rank may bake that rank's constants into a graph whose guards name no rank (no DTensor
  input), so while simulated ranks share dynamo's cache the ``in_graph`` calls and the hooks run
  eagerly (``_ranks_share_dynamo``).
- The graph's own ops on DTensors are traced through ``__torch_dispatch__`` by AOTAutograd;
  ``__coerce_tangent_metadata__`` says a Partial output's gradient arrives reduced.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.abc
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

import torch

from .comm import current_transport, simulated
from .version import __version__

if TYPE_CHECKING:
    from .spec import DTensorSpec

__all__ = ["in_graph", "keep_dynamo_out", "methods_traced", "metadata", "rank_key", "stable_hash"]

_TRACED: list[bool] = []  # whether placements and meshes are graph constants (set when dynamo loads)
_IN_GRAPH: list[Callable] = []  # functions that compiled code calls as one node of its graph
_DYNAMO_READS = ("parallel/hooks.py", "fsdp/hooks.py", "groups.py", "experimental.py")
"""The package's files that dynamo traces: forward hooks and ``local_map``'s wrapper, whose
bodies only read DTensor metadata, call DTensor methods and ``in_graph`` functions, so a
compiled module with parallel styles, ``fully_shard`` or ``local_map`` is one graph."""
_USER_CODE = ("examples",)
"""The package's models (the demo's ``TinyLM``): user code, which dynamo traces like any model's."""
_ROOT = os.path.dirname(os.path.abspath(__file__))


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
    _TRACED.append(_register_constants())
    _skip_package(getattr(sys.modules.get("torch._dynamo"), "trace_rules", None), _TRACED[0])
    if _TRACED[0]:
        for fn in _IN_GRAPH:
            torch.compiler.allow_in_graph(fn)
        simulated.ON_SHARED.append(_ranks_share_dynamo)
        if simulated.SHARED_RANKS:
            _ranks_share_dynamo(True)


def _ranks_share_dynamo(shared: bool) -> None:
    """While simulated ranks (threads sharing dynamo's cache) run, compiled code calls the
    ``in_graph`` functions and the hooks of ``_DYNAMO_READS`` eagerly, as graph breaks: such a call
    traced on one rank bakes that rank's constants (its block, its padding) into the graph, and
    when no graph input is a DTensor nothing in the guards names the rank, so another rank could
    reuse the graph.  Processes each compile their own graphs and keep them in the graph."""
    rules = sys.modules["torch._dynamo"].trace_rules
    allowed, skip = getattr(rules, "_allowed_callable_ids", None), _skip_list(rules)
    if allowed is None or skip is None:
        return
    skip_dirs, recompile = skip
    for fn in _IN_GRAPH:
        if shared:
            allowed.remove(id(fn))
        else:
            allowed.add(id(fn))
    for path in (os.path.join(_ROOT, f) for f in _DYNAMO_READS):
        if shared:
            skip_dirs.append(path)
        elif path in skip_dirs:
            skip_dirs.remove(path)
    recompile()


def _skip_list(rules: Any) -> tuple[list, Callable] | None:
    """dynamo's list of skipped path prefixes and the call that makes a change take effect."""
    skip_dirs, recompile = getattr(rules, "SKIP_DIRS", None), getattr(rules, "_recompile_re", None)
    return (skip_dirs, recompile) if isinstance(skip_dirs, list) and recompile is not None else None


def _skip_package(rules: Any, reads: bool) -> None:
    """Every file of the package on dynamo's skip list except the models of ``_USER_CODE``, and
    ``_DYNAMO_READS`` when ``reads`` (placements are graph constants, so what the hooks call is a
    node of the graph)."""
    if rules is None or not hasattr(rules, "add"):
        return
    skip = _skip_list(rules)
    if skip is None:  # the whole package
        rules.add(__name__.split(".")[0])
        return
    skip_dirs, recompile = skip
    read = {os.path.join(_ROOT, f) for f in _USER_CODE + (_DYNAMO_READS if reads else ())}
    for path in sorted(os.listdir(_ROOT)):
        full = os.path.join(_ROOT, path)
        if full in read:
            continue
        if not any(r.startswith(full + os.sep) for r in read):
            skip_dirs.append(full + os.sep if os.path.isdir(full) else full)
        else:
            skip_dirs.extend(os.path.join(full, f) for f in sorted(os.listdir(full)) if os.path.join(full, f) not in read)
    recompile()


def _register_constants() -> bool:
    """Placements and meshes as constants of compiled graphs (see the module docstring);
    ``SHARDTENSOR_COMPILE_CONSTANTS=0`` keeps them plain objects (and those calls graph breaks)."""
    if os.environ.get("SHARDTENSOR_COMPILE_CONSTANTS", "1") == "0":
        return False
    from .mesh import DeviceMesh
    from .placement import PLACEMENTS, NormPartial
    try:
        from torch._library import opaque_object
    except ImportError:
        return False
    MemberType = getattr(opaque_object, "MemberType", None)
    register = getattr(opaque_object, "register_custom_class", None) or getattr(  # 2.15 renamed it
        opaque_object, "register_opaque_type", None)
    if MemberType is None or register is None:
        return False
    placement = ("is_shard", "is_replicate", "is_partial", "__eq__", "__hash__")
    members: dict[type, tuple[str, ...]] = {
        cls: placement + tuple(f.name for f in dataclasses.fields(cls)) for cls in (*PLACEMENTS, NormPartial)}  # type: ignore[arg-type]
    # not the calling rank's get_rank/get_coordinate/get_local_rank: read at compile time they would
    # be baked into a graph that simulated ranks (threads sharing dynamo's cache) reuse.  _group_key
    # names this rank's group too, but only processes have groups: in a simulated world the
    # lookup it keys finds none and the eager call raises
    members.update({DeviceMesh: ("ndim", "shape", "size", "mesh_dim_names", "device_type", "_group_key", "__eq__", "__hash__")})
    inlined: dict[type, tuple[str, ...]] = {DeviceMesh: ("get_group",)}  # groups.py: reads its process group from a module global
    for typ in ("constant", "value"):  # torch 2.15 renamed "value" to "constant"
        try:
            for cls, names in members.items():  # read at compile time on the real object
                register(cls, typ=typ, members={**dict.fromkeys(names, MemberType.USE_REAL),
                                                **dict.fromkeys(inlined.get(cls, ()), MemberType.INLINED)})
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


def metadata(t: Any) -> tuple:
    """A DTensor's compile metadata ``(spec, rank)``: its last (``t._flat_meta``) where it still
    holds.  Dynamo's guards ask for it twice per DTensor input per call, and the rank lookup costs
    1-2 us under torch.distributed, so it is made again only when the spec changed or when a
    simulated rank other than the one that made it reads it (a copy handed between ranks'
    threads); a process keeps its rank.  A ``mark_dynamic`` on ``t`` is refused here."""
    if getattr(t, "_dynamo_dynamic_indices", None):
        refuse_dynamic(t)
    cached, spec = t._flat_meta, t._spec
    if cached is not None and cached[0] is spec:
        t = simulated.current_sim_transport()
        if t is None or t.rank == cached[1]:
            return cached
    return spec, rank_key()


@functools.cache
def _code_digest() -> str:
    """A digest of the package's source: a changed shardtensor (even at one version number, as
    while developing it) never reuses traces cached on disk by another one."""
    h = hashlib.blake2b(digest_size=16)
    for dirpath, dirnames, files in sorted(os.walk(_ROOT)):
        dirnames.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    h.update(f.encode() + fh.read())
    return h.hexdigest()


def stable_hash(spec: "DTensorSpec", local: torch.Tensor) -> str:
    """A digest of what a DTensor's traces depend on, the same in every process."""
    m = spec.mesh
    key = (__version__, _code_digest(), m.device_type, m.shape, m._all, m.mesh_dim_names, repr(spec.placements), spec.shard_order,
           tuple(spec.shape), spec.stride, str(spec.dtype), rank_key(), tuple(local.shape), local.stride(),
           str(local.dtype), local.device.type)
    return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()


def refuse_dynamic(t: Any) -> None:
    """``torch._dynamo.mark_dynamic`` on a DTensor: its sizes specialize under ``torch.compile``
    (the spec, the plans and the local kernels are built for one global shape), so the mark
    could only fail later, deep in dynamo's guards; say so here, with what to do."""
    dims = sorted(t._dynamo_dynamic_indices)
    raise TypeError(
        f"shardtensor: torch._dynamo.mark_dynamic(dtensor, {dims[0] if len(dims) == 1 else dims}) on a DTensor of "
        f"global shape {tuple(t.shape)} ({t._spec}): DTensor sizes are static under torch.compile (each global "
        f"shape compiles once; a new shape recompiles). Remove the mark, or use "
        f"torch._dynamo.maybe_mark_dynamic, which lets the dim specialize.")
