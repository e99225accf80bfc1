"""Parallel styles: how one module's parameters are sharded and its inputs/outputs converted.

Argument names, defaults and behaviour follow ``torch.distributed.tensor.parallel`` so a
plan written for PyTorch runs with only the import changed.  Two deliberate differences,
both only where PyTorch would compute with a wrong layout: a DTensor input is redistributed
when its *actual* placements differ from the desired ones (not only when the declared
layouts differ), and a plain tensor input wrapped as sharded gets its true global size
(uneven shards), see ``local_to_dtensor``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from functools import lru_cache
from typing import Any, Sequence

import torch
import torch.nn as nn

from .. import comm
from ..compile import in_graph
from ..mesh import DeviceMesh
from ..placement import Placement, Replicate, Shard, normalize_placements, shard_dim
from ..tensor import DTensor, distribute_tensor
from .hooks import ConvertInputs, ConvertOutputs
from .module import distribute_module

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput",
           "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel", "local_to_dtensor"]


def local_to_dtensor(t: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
                     known: dict[int, int] | None = None) -> DTensor:
    """Wrap this rank's local piece ``t`` as a DTensor with ``placements``.

    The global size of a dim sharded over one mesh dim is taken from ``known`` (tensor dim,
    negative allowed -> global size) or else summed from one all-gather of the local sizes
    over that mesh dim, so uneven shards get their real shape (``from_local`` alone assumes
    even ones).  Every rank must call this with the same arguments except ``t``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or DTensor module input/output, got {type(t).__name__}")
    try:
        pl, shards = _layout(tuple(placements), t.ndim, mesh.ndim)
    except TypeError:  # an unhashable placement: the uncached check says what is wrong
        normalize_placements(tuple(placements), t.ndim, mesh.ndim)
        raise
    if not shards:
        return DTensor.from_local(t, mesh, pl)
    if any(len(js) > 1 for _, js in shards):
        return DTensor.from_local(t, mesh, pl, run_check=True)
    shape = list(t.shape)
    given = {(d + t.ndim if d < 0 else d): n for d, n in (known or {}).items()}
    by_mesh_dim: dict[int, list[int]] = {}
    for d, (j,) in shards:
        if d in given:
            shape[d] = int(given[d])
        else:
            by_mesh_dim.setdefault(j, []).append(d)
    for j, dims in sorted(by_mesh_dim.items()):
        sizes = torch.tensor([t.shape[d] for d in dims], dtype=torch.int64, device=t.device)
        totals = comm.all_gather(sizes, mesh, j).sum(0).tolist()
        for d, n in zip(dims, totals):
            shape[d] = int(n)
    return DTensor.from_local(t, mesh, pl, shape=shape)


@lru_cache(maxsize=256)
def _layout(placements: tuple, ndim: int, mesh_ndim: int) -> tuple[tuple[Placement, ...], tuple]:
    """Placements checked for a tensor of ``ndim`` dims, and the mesh dims sharding each tensor dim
    (``(dim, mesh dims)`` pairs): worked out once per layout, not per wrapped input."""
    pl = normalize_placements(placements, ndim, mesh_ndim)
    shards: dict[int, list[int]] = {}
    for j, p in enumerate(pl):
        d = shard_dim(p)
        if d is not None:
            shards.setdefault(d, []).append(j)
    return pl, tuple((d, tuple(js)) for d, js in shards.items())


def _to_dtensor(x: Any, mesh: DeviceMesh, layout: Placement, known: dict[int, int] | None = None) -> DTensor:
    if isinstance(x, DTensor):
        return x
    return local_to_dtensor(x, mesh, (layout,), known)


def _redistribute_to(x: DTensor, layout: Placement) -> DTensor:
    spec = x._spec  # (not x.ndim and the like: each would be a torch-function call)
    if spec.mesh.ndim != 1:
        raise ValueError(f"tensor parallel styles need DTensors on a 1-D mesh, got one on {spec.mesh}")
    want = _layout((layout,), len(spec.shape), 1)[0]
    return x if spec.placements == want else x.redistribute(spec.mesh, want)


@in_graph
def _convert(x: Any, mesh: DeviceMesh, layout: Placement | None, desired: Placement | None, use_local: bool,
             known: tuple = (), must_be_dtensor: str = "") -> Any:
    """One value through a style's hook: a plain tensor taken as this rank's piece of a DTensor
    with ``layout`` (``None``: the value is left alone), redistributed to ``desired`` and
    unwrapped when ``use_local``.  ``must_be_dtensor`` names the module whose output this is.
    One node of a compiled graph (``hooks.py``)."""
    if must_be_dtensor and not isinstance(x, DTensor):
        raise TypeError(f"{must_be_dtensor} returned {type(x).__name__}, expected a DTensor")
    if layout is None:
        return x
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or DTensor for layout {layout!r}, got {type(x).__name__}")
    dt = _to_dtensor(x, mesh, layout, dict(known))
    if desired is not None:
        dt = _redistribute_to(dt, desired)
    return dt.to_local() if use_local else dt


@in_graph
def _unwrap(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def _shard_params(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement],
                  src_data_rank: int | None) -> None:
    for name, placement in placements.items():
        p = getattr(module, name, None)
        if p is None or isinstance(p, DTensor):
            continue
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(p.data, mesh, [placement], src_data_rank=src_data_rank), requires_grad=p.requires_grad))


def _known_input_sizes(module: nn.Module) -> dict[int, int]:
    return {-1: module.in_features} if isinstance(module, nn.Linear) else {}


class ParallelStyle(ABC):
    """How to parallelize one module; ``_apply(module, device_mesh)`` does it in place."""

    src_data_rank: int | None = 0

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...


class _LinearEmbeddingStyle(ParallelStyle):
    """Shared plumbing of Colwise/Rowwise: one input in, one output out."""

    input_layouts: tuple[Placement, ...]
    output_layouts: tuple[Placement, ...]
    desired_input_layouts: tuple[Placement, ...]
    use_local_output: bool

    def _param_placements(self, module: nn.Module) -> dict[str, Placement]:
        raise NotImplementedError

    def _desired_input(self, module: nn.Module) -> Placement:
        raise NotImplementedError

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise NotImplementedError(f"{name} supports nn.Linear and nn.Embedding, got {type(module).__name__}")
        placements = self._param_placements(module)
        self.desired_input_layouts = (self._desired_input(module),)
        known = tuple(_known_input_sizes(module).items())

        def partition(_: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is module:
                _shard_params(mod, mesh, placements, self.src_data_rank)

        distribute_module(module, device_mesh, partition)
        module.register_forward_pre_hook(ConvertInputs(
            _convert, ((device_mesh, self.input_layouts[0], self.desired_input_layouts[0], False, known),), name))
        out = self.output_layouts[0]
        module.register_forward_hook(ConvertOutputs(
            _convert, ((device_mesh, out, out, self.use_local_output, (), f"{name}: {type(module).__name__}"),), name))
        return module

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
                f"use_local_output={self.use_local_output})")


class ColwiseParallel(_LinearEmbeddingStyle):
    """Shard a Linear's output features (weight and bias ``Shard(0)``) or an Embedding's
    embedding dim (weight ``Shard(1)``).

    Input: ``input_layouts`` (default ``Replicate()``), redistributed to ``Replicate()``.
    Output: sharded on the last dim, redistributed to ``output_layouts`` (default
    ``Shard(-1)``) and returned as the local tensor when ``use_local_output``.
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        self.input_layouts = (input_layouts or Replicate(),)
        self.output_layouts = (output_layouts or Shard(-1),)
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output

    def _param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Embedding):
            return {name: Shard(1) for name, _ in module.named_parameters(recurse=False)}
        return {name: Shard(0) for name, _ in module.named_parameters(recurse=False)}

    def _desired_input(self, module: nn.Module) -> Placement:
        return Replicate()


class RowwiseParallel(_LinearEmbeddingStyle):
    """Shard a Linear's input features (weight ``Shard(1)``, bias replicated) or an
    Embedding's rows (weight ``Shard(0)``).

    Input: ``input_layouts`` (default ``Shard(-1)``), redistributed to ``Shard(-1)`` for a
    Linear and ``Replicate()`` for an Embedding.  Output: the Partial sum, reduced to
    ``output_layouts`` (default ``Replicate()``: all-reduce; ``Shard(d)``: reduce-scatter),
    returned as the local tensor when ``use_local_output``.
    """

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True) -> None:
        self.input_layouts = (input_layouts or Shard(-1),)
        self.output_layouts = (output_layouts or Replicate(),)
        self.use_local_output = use_local_output

    def _param_placements(self, module: nn.Module) -> dict[str, Placement]:
        if isinstance(module, nn.Embedding):
            return {name: Shard(0) for name, _ in module.named_parameters(recurse=False)}
        return {"weight": Shard(1), "bias": Replicate()}

    def _desired_input(self, module: nn.Module) -> Placement:
        return Replicate() if isinstance(module, nn.Embedding) else Shard(-1)


class SequenceParallel(ParallelStyle):
    """Run a module (LayerNorm, RMSNorm, dropout, ...) on activations sharded along
    ``sequence_dim``; its parameters are replicated.

    A DTensor input is redistributed to ``Shard(sequence_dim)``; a plain tensor is taken as
    this rank's sequence shard.  The output stays a DTensor unless ``use_local_output``.
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = self.sequence_sharding[0]

        def partition(_: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            _shard_params(mod, mesh, {n: Replicate() for n, _ in mod.named_parameters(recurse=False)},
                          self.src_data_rank)

        distribute_module(module, device_mesh, partition)
        module.register_forward_pre_hook(ConvertInputs(_convert, ((device_mesh, layout, layout, False),),
                                                       "SequenceParallel"))
        if self.use_local_output:
            module.register_forward_hook(ConvertOutputs(_unwrap, ((),), "SequenceParallel"))
        return module

    def __repr__(self) -> str:
        return (f"SequenceParallel(sequence_dim={self.sequence_sharding[0].dim}, "
                f"use_local_output={self.use_local_output})")


def _as_layouts(x: Placement | Sequence[Placement | None] | None) -> tuple[Placement | None, ...] | None:
    if x is None:
        return None
    return (x,) if isinstance(x, Placement) else tuple(x)


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs before ``forward``: each positional input (and keyword input
    named in ``input_kwarg_layouts``) is annotated with its layout and redistributed to the
    desired one; ``None`` layouts leave that input alone.
    """

    def __init__(self, *, input_layouts: Placement | Sequence[Placement | None] | None = None,
                 desired_input_layouts: Placement | Sequence[Placement | None] | None = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = _as_layouts(input_layouts)
        self.desired_input_layouts = _as_layouts(desired_input_layouts)
        self.use_local_output = use_local_output
        if self.input_layouts is not None:
            if self.desired_input_layouts is None:
                raise ValueError("PrepareModuleInput: input_layouts needs desired_input_layouts")
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise ValueError(f"PrepareModuleInput: {len(self.input_layouts)} input_layouts but "
                                 f"{len(self.desired_input_layouts)} desired_input_layouts")
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if self.with_kwargs and len(self.input_kwarg_layouts) != len(self.desired_input_kwarg_layouts):
            raise ValueError("PrepareModuleInput: input_kwarg_layouts and desired_input_kwarg_layouts differ in length")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        local = self.use_local_output
        rules = None if self.input_layouts is None else tuple(
            (device_mesh, lay, want, local) for lay, want in zip(self.input_layouts, self.desired_input_layouts or ()))
        kw = None if not self.with_kwargs else {
            k: (device_mesh, lay, self.desired_input_kwarg_layouts.get(k), local)
            for k, lay in self.input_kwarg_layouts.items()}
        module.register_forward_pre_hook(ConvertInputs(_convert, rules, "PrepareModuleInput", exact=True, kw_rules=kw),
                                         with_kwargs=self.with_kwargs)
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleInput(input_layouts={self.input_layouts}, desired_input_layouts="
                f"{self.desired_input_layouts}, input_kwarg_layouts={self.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs after ``forward``: each output is annotated with its layout
    (``None``: left alone) and redistributed to the desired one."""

    def __init__(self, *, output_layouts: Placement | Sequence[Placement | None],
                 desired_output_layouts: Placement | Sequence[Placement], use_local_output: bool = True) -> None:
        self.output_layouts = _as_layouts(output_layouts)
        self.desired_output_layouts = _as_layouts(desired_output_layouts)
        self.use_local_output = use_local_output
        if self.output_layouts is None or self.desired_output_layouts is None:
            raise ValueError("PrepareModuleOutput needs output_layouts and desired_output_layouts")
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(f"PrepareModuleOutput: {len(self.output_layouts)} output_layouts but "
                             f"{len(self.desired_output_layouts)} desired_output_layouts")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert self.output_layouts is not None and self.desired_output_layouts is not None
        rules = tuple((device_mesh, lay, want, self.use_local_output)
                      for lay, want in zip(self.output_layouts, self.desired_output_layouts))
        module.register_forward_hook(ConvertOutputs(_convert, rules, "PrepareModuleOutput", exact=True))
        return module

    def __repr__(self) -> str:
        return (f"PrepareModuleOutput(output_layouts={self.output_layouts}, desired_output_layouts="
                f"{self.desired_output_layouts}, use_local_output={self.use_local_output})")


class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module."""

    def __init__(self, *, input_layouts: Placement | Sequence[Placement | None] | None = None,
                 desired_input_layouts: Placement | Sequence[Placement | None] | None = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_input: bool = False,
                 output_layouts: Placement | Sequence[Placement | None],
                 desired_output_layouts: Placement | Sequence[Placement], use_local_output: bool = True) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return f"PrepareModuleInputOutput({self.prepare_module_input!r}, {self.prepare_module_output!r})"
