"""The drop-in switch: torch's public DTensor names point at shardtensor's, for code imported after.

``install()`` (or ``python -m shardtensor.dropin script.py args``, also under ``torchrun``)
replaces each torch module that ``_switched()`` names (in ``sys.modules`` and as its parent's
attribute) by a module showing shardtensor's object for every public name that has one.  A public name without
an equivalent raises a clear error when used (never torch's DTensor machinery on our tensors);
private names fall through to torch's module.  torch's own modules are imported first and keep
the objects they bound (their functions read their own globals), so torch's internals keep
torch's classes.  ``uninstall()`` puts torch's modules back.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import sys
import types
from typing import Any

import torch

KEEP = "torch's own"
"""A public name torch's module keeps (typing aliases): not a DTensor feature."""


def _switched() -> dict[str, dict[str, Any]]:
    """torch module -> {public name: shardtensor's object, or KEEP}."""
    from . import (DTensor, DeviceMesh, Partial, Placement, Replicate, Shard, StridedShard,
                   compute_local_shape_and_global_offset, distribute_module, distribute_tensor, empty, full,
                   init_device_mesh, ones, rand, randn, zeros)
    from .checkpoint import state_dict as sd
    from .debug import CommDebugMode, visualize_sharding
    from .cp.api import (context_parallel, context_parallel_shard, context_parallel_unshard, disable_dispatcher,
                         enable_dispatcher, set_rotate_method)
    from .experimental import implicit_replication, local_map, register_sharding
    from .fsdp import (CPUOffloadPolicy, DataParallelMeshDims, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                       UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx)
    from .parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput,
                           PrepareModuleOutput, RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module)

    placements = {"Placement": Placement, "Shard": Shard, "Replicate": Replicate, "Partial": Partial}
    styles = {"ColwiseParallel": ColwiseParallel, "ParallelStyle": ParallelStyle,
              "PrepareModuleInput": PrepareModuleInput, "PrepareModuleInputOutput": PrepareModuleInputOutput,
              "PrepareModuleOutput": PrepareModuleOutput, "RowwiseParallel": RowwiseParallel,
              "SequenceParallel": SequenceParallel}
    api = {"DTensor": DTensor, "distribute_tensor": distribute_tensor, "distribute_module": distribute_module,
           "ones": ones, "empty": empty, "full": full, "rand": rand, "randn": randn, "zeros": zeros}
    meshes = {"DeviceMesh": DeviceMesh, "init_device_mesh": init_device_mesh}
    cp = {"context_parallel": context_parallel, "context_parallel_unshard": context_parallel_unshard,
          "set_rotate_method": set_rotate_method, "_context_parallel_shard": context_parallel_shard,
          "_enable_context_parallel_dispatcher": enable_dispatcher,
          "_disable_context_parallel_dispatcher": disable_dispatcher}
    fsdp = {"fully_shard": fully_shard, "FSDPModule": FSDPModule, "MixedPrecisionPolicy": MixedPrecisionPolicy,
            "UnshardHandle": UnshardHandle, "OffloadPolicy": OffloadPolicy, "CPUOffloadPolicy": CPUOffloadPolicy,
            "register_fsdp_forward_method": register_fsdp_forward_method, "share_comm_ctx": share_comm_ctx,
            "DataParallelMeshDims": DataParallelMeshDims}
    # every module path torch users import these names from, the older and private ones included
    # (``isinstance(m, torch.distributed._composable.fsdp.FSDPModule)`` holds for ours)
    return {
        "torch.distributed.tensor": {**api, **meshes, **placements},
        "torch.distributed.tensor._api": api,
        "torch.distributed._tensor": {**api, **meshes, **placements},
        "torch.distributed._tensor.api": api,
        "torch.distributed.tensor.placement_types": {**placements, "_StridedShard": StridedShard},
        "torch.distributed._tensor.placement_types": {**placements, "_StridedShard": StridedShard},
        "torch.distributed.device_mesh": meshes,
        "torch.distributed.tensor.device_mesh": meshes,
        "torch.distributed.tensor.parallel": {**styles, "parallelize_module": parallelize_module,
                                              "loss_parallel": loss_parallel},
        "torch.distributed.tensor.parallel.api": {"parallelize_module": parallelize_module},
        "torch.distributed.tensor.parallel.loss": {"loss_parallel": loss_parallel},
        "torch.distributed.tensor.parallel.style": styles,
        "torch.distributed.tensor.experimental": {"local_map": local_map, "implicit_replication": implicit_replication,
                                                 "register_sharding": register_sharding,
                                                 "context_parallel": context_parallel},
        "torch.distributed.tensor.experimental._attention": cp,
        "torch.distributed.tensor.experimental._context_parallel._attention": cp,
        "torch.distributed.tensor.experimental._func_map": {"local_map": local_map},
        "torch.distributed.tensor.experimental._register_sharding": {"register_sharding": register_sharding},
        "torch.distributed.tensor.debug": {"visualize_sharding": visualize_sharding, "CommDebugMode": CommDebugMode},
        "torch.distributed.fsdp": fsdp,
        "torch.distributed.fsdp._fully_shard": fsdp,
        "torch.distributed.fsdp._fully_shard._fully_shard": fsdp,
        "torch.distributed.fsdp._fully_shard._fsdp_api": {"MixedPrecisionPolicy": MixedPrecisionPolicy,
                                                           "DataParallelMeshDims": DataParallelMeshDims},
        "torch.distributed._composable.fsdp": fsdp,
        "torch.distributed._composable.fsdp.fully_shard": fsdp,
        "torch.distributed.checkpoint.state_dict": {
            **{n: getattr(sd, n) for n in sd.__all__},
            **dict.fromkeys(("FQNS_T", "PrimitiveType", "ValueType", "DictValueType", "ListDictValueType",
                             "OptimizerStateType"), KEEP)},
        "torch.distributed.tensor._utils": {
            "compute_local_shape_and_global_offset": compute_local_shape_and_global_offset},
    }


class _MissingMeta(type):
    """A name shardtensor lacks: nothing is an instance of it, and any use raises, naming it."""

    _where: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(cls._message())

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("_"):  # probes (hasattr, typing, inspect) see a plain class
            raise AttributeError(attr)
        raise NotImplementedError(cls._message())

    def __instancecheck__(cls, obj: Any) -> bool:
        return False

    def __subclasscheck__(cls, sub: Any) -> bool:
        return False

    def _message(cls) -> str:
        return (f"{cls._where} has no shardtensor equivalent, and shardtensor.dropin is installed (so it is not "
                "torch's either: torch's would not work on shardtensor's tensors); see docs/coming-from-torch.md "
                "for what the drop-in covers, or call shardtensor.dropin.uninstall() first")


def _missing(where: str) -> type:
    return _MissingMeta(where.rpartition(".")[2], (), {"_where": where})


class _Switched(types.ModuleType):
    """A torch module as the drop-in shows it: shardtensor's names (or stand-ins for the missing
    ones) to every reader but torch's own modules, which get torch's objects; private names and
    submodules are torch's."""

    def __init__(self, torch_module: types.ModuleType, names: dict[str, Any]) -> None:
        super().__init__(torch_module.__name__, torch_module.__doc__)
        for attr in ("__file__", "__path__", "__spec__", "__package__", "__loader__", "__all__"):
            if hasattr(torch_module, attr):
                setattr(self, attr, getattr(torch_module, attr))
        # a public module's other public names are stand-ins; a private one's stay torch's
        public = not any(part.startswith("_") for part in torch_module.__name__.split("."))
        shown = {n: _missing(f"{torch_module.__name__}.{n}") for n in getattr(torch_module, "__all__", ()) if public}
        shown.update({n: getattr(torch_module, n) if ours is KEEP else ours for n, ours in names.items()})
        object.__setattr__(self, "_torch_module", torch_module)
        object.__setattr__(self, "_shown", shown)

    def __getattr__(self, name: str) -> Any:  # the public names live outside __dict__, so they come here
        shown = self._shown.get(name, _TORCHS)
        if shown is _TORCHS or _read_by_torch(sys._getframe(1)):
            return getattr(self._torch_module, name)
        return shown

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._shown))


_TORCHS = object()
_USER_SIDE = ("torch.testing.", "torch._dynamo.variables.misc", "torch._dynamo.guards")
"""torch modules that read names for user code: test harnesses, and dynamo reading (and guarding)
the module attributes of the code it traces."""


def _read_by_torch(frame: types.FrameType) -> bool:
    """Whether the code reading a name is torch's own (its internals keep torch's classes)."""
    name = frame.f_globals.get("__name__", "")
    return (name == "torch" or name.startswith("torch.")) and not name.startswith(_USER_SIDE)


class _Probe(torch.Tensor):
    """A tensor subclass with nothing in it (see ``_prime_torch``)."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...]) -> "_Probe":
        return torch.Tensor._make_wrapper_subclass(cls, shape)  # type: ignore[attr-defined]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        return torch.zeros(())


def _prime_torch() -> None:
    """torch's C++ looks ``torch.distributed.tensor.DTensor`` up once, when a tensor subclass
    first dispatches; that happens here, before the switch, so it finds torch's class."""
    _Probe((1,)).detach()


_ORIGINAL: dict[str, types.ModuleType] = {}  # sys.modules names -> torch's modules
_PARENT_ATTRS: list[tuple[types.ModuleType, str, Any]] = []  # (module, attribute, torch's value) set here

_ON_DIST = ("DeviceMesh", "init_device_mesh")
"""Names torch.distributed re-exports (``torch.distributed.init_device_mesh``, as transformers
calls it), set on the module itself: no torch code reads them there."""


def _patches() -> list[tuple[Any, str, Any]]:
    """(torch module, attribute, ours): single functions the drop-in replaces in place."""
    import torch.distributed._functional_collectives as funcol

    from .groups import resolving_meshes
    from .mesh import DeviceMesh
    # torch 2.13 resolves every group through _resolve_group; 2.11 through _resolve_group_name
    name = "_resolve_group" if hasattr(funcol, "_resolve_group") else "_resolve_group_name"
    return [(funcol, name, resolving_meshes(getattr(funcol, name), DeviceMesh))]


def _exists(name: str) -> bool:
    """Whether torch has module ``name`` (an older release may lack a newer private path)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def installed() -> bool:
    return bool(_ORIGINAL)


def install() -> None:
    """Point torch's public DTensor, DeviceMesh, TP, FSDP2 and state-dict names at shardtensor's
    for code imported (or attributes read) from now on.  Safe to call twice."""
    if _ORIGINAL:
        return
    table = {name: names for name, names in _switched().items() if _exists(name)}
    _prime_torch()
    torch_modules = {name: importlib.import_module(name) for name in table}  # theirs bind torch's classes first
    shims = {}
    for name in sorted(table, key=lambda n: n.count(".")):  # parents first: children attach to their shims
        module = torch_modules[name]
        shim = shims[id(module)] = _Switched(module, table[name])
        _ORIGINAL[name] = module
        sys.modules[name] = shim
        parent, _, leaf = name.rpartition(".")
        holder = sys.modules[parent]
        if getattr(holder, leaf, None) is module:  # (a package may bind a function of the same name there)
            _PARENT_ATTRS.append((holder, leaf, module))
            setattr(holder, leaf, shim)
    # torch's aliases of a switched module (torch.distributed._tensor.device_mesh) show the shim too
    for name, module in list(sys.modules.items()):
        if id(module) in shims and name not in _ORIGINAL:
            _ORIGINAL[name] = module
            sys.modules[name] = shims[id(module)]
    mesh_names = table["torch.distributed.device_mesh"]
    for name in _ON_DIST:
        _PARENT_ATTRS.append((torch.distributed, name, getattr(torch.distributed, name)))
        setattr(torch.distributed, name, mesh_names[name])
    for module, attr, ours in _patches():
        _PARENT_ATTRS.append((module, attr, getattr(module, attr)))
        setattr(module, attr, ours)


def uninstall() -> None:
    """Put torch's modules back (objects already imported from the shims stay what they are)."""
    for name, module in _ORIGINAL.items():
        sys.modules[name] = module
    for holder, leaf, theirs in reversed(_PARENT_ATTRS):
        setattr(holder, leaf, theirs)
    _ORIGINAL.clear()
    _PARENT_ATTRS.clear()


def main(argv: list[str] | None = None) -> None:
    """``python -m shardtensor.dropin script.py args`` or ``... -m package.module args``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        print("usage: python -m shardtensor.dropin script.py [args...]\n"
              "       python -m shardtensor.dropin -m package.module [args...]\n"
              "runs the script with torch.distributed.tensor, device_mesh, tensor.parallel, fsdp and "
              "checkpoint.state_dict pointing at shardtensor (also under torchrun)", file=sys.stderr)
        raise SystemExit(0 if args and args[0] in ("-h", "--help") else 2)
    # install from the module itself, not from this ``__main__`` copy of it: its objects and
    # state are then the ones user code and dynamo see (dynamo skips ``__main__``'s file here)
    importlib.import_module("shardtensor.dropin").install()
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))  # as python script.py does
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
