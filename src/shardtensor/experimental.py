"""``local_map``, ``implicit_replication``, ``register_sharding`` and ``context_parallel``, as in
``torch.distributed.tensor.experimental``."""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .cp.api import context_parallel
from .implicit import implicit_replication
from .mesh import DeviceMesh
from .placement import Placement, display
from .tensor import DTensor

__all__ = ["context_parallel", "implicit_replication", "local_map", "register_sharding"]

PlacementType = Sequence[Placement] | None


def local_map(func: Callable[..., Any] | None = None, out_placements: Any = None, in_placements: Any = None,
              in_grad_placements: Any = None, device_mesh: DeviceMesh | None = None, *,
              redistribute_inputs: bool = False) -> Any:
    """Run ``func`` on the local tensors of its DTensor arguments and wrap its outputs as DTensors.

    ``in_placements`` gives, per flattened argument, the placements a DTensor argument must
    have (``None`` for other arguments); one that differs is redistributed with
    ``redistribute_inputs=True`` and refused otherwise.  ``out_placements`` gives the placements
    of each flattened output (one placements sequence for a single output, a tuple of them, one
    per output, for any number, ``None`` for an output that is not a tensor).
    ``in_grad_placements`` are the placements of the gradients flowing back to the inputs
    (default, or ``None`` entries: the inputs'); a replicated input whose local gradients are
    only this rank's terms needs ``[Partial()]`` there, as in torch.  Without DTensor arguments
    ``func`` runs as is.  Outputs whose placements shard a dim get their global shape from one
    small all-gather of the local sizes, so uneven outputs are right.  Without ``func``,
    returns a decorator.
    """
    if func is None:
        return functools.partial(local_map, out_placements=out_placements, in_placements=in_placements,
                                 in_grad_placements=in_grad_placements, device_mesh=device_mesh,
                                 redistribute_inputs=redistribute_inputs)
    if not callable(func):
        raise TypeError(f"local_map: func must be callable, got {func!r}")

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        flat, tree = tree_flatten(args)
        mesh = device_mesh
        if in_placements is not None and len(in_placements) != len(flat):
            raise ValueError(f"local_map: in_placements has {len(in_placements)} entries for {len(flat)} "
                             "flattened arguments")
        local = []
        for i, a in enumerate(flat):
            if not isinstance(a, DTensor):
                local.append(a)
                continue
            mesh = mesh if mesh is not None else a.device_mesh
            if a.device_mesh != mesh:
                raise ValueError(f"local_map: argument {i} lives on {a.device_mesh}, expected {mesh}")
            want = None if in_placements is None else in_placements[i]
            if want is not None and tuple(want) != tuple(a.placements):
                if not redistribute_inputs:
                    raise ValueError(f"local_map: argument {i} has placements {display(a.placements)}, "
                                     f"in_placements asks for {display(want)}; pass redistribute_inputs=True "
                                     "to redistribute it")
                a = a.redistribute(mesh, want)
            grad = None if in_grad_placements is None else in_grad_placements[i]
            local.append(a.to_local(grad_placements=grad))
        out = func(*tree_unflatten(local, tree), **kwargs)
        if mesh is None:
            return out
        return _wrap_outputs(out, out_placements, mesh)

    return wrapped


def _wrap_outputs(out: Any, out_placements: Any, mesh: DeviceMesh) -> Any:
    """The outputs as DTensors: a tuple (or list) of placement sequences gives one per flattened
    output (torch's reading: ``((Partial(),),)`` for one output); a sequence of placements or
    ``None`` is the one output's."""
    flat, tree = tree_flatten(out)
    per_output = isinstance(out_placements, (tuple, list)) and (
        not out_placements or not all(isinstance(p, Placement) for p in out_placements))
    entries = tuple(out_placements) if per_output else (out_placements,)
    if len(entries) != len(flat):
        raise ValueError(f"local_map: func returned {len(flat)} outputs (flattened) for {len(entries)} out_placements "
                         "entries; give one placements sequence (or None) per output")
    return tree_unflatten([_wrap_one(o, p, mesh) for o, p in zip(flat, entries)], tree)


def _wrap_one(out: Any, placements: PlacementType, mesh: DeviceMesh) -> Any:
    if placements is None:
        if isinstance(out, torch.Tensor):
            raise ValueError("local_map: an output is a tensor but its out_placements entry is None")
        return out
    if not isinstance(out, torch.Tensor) or isinstance(out, DTensor):
        raise ValueError(f"local_map: out_placements {display(placements)} given for an output of type "
                         f"{type(out).__name__}, expected a plain torch.Tensor")
    return DTensor.from_local(out, mesh, placements)


def register_sharding(op: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn`` lists the shardings ``op`` (an overload, or a list of them) accepts, in
    torch's form, replacing any rule the op had.

    ``fn`` takes the op's arguments with every DTensor replaced by its spec (``.shape``,
    ``.ndim``, ``.placements``, ``.mesh``) and returns ``(output_placements, input_placements)``
    pairs for one mesh dim: one placement per output (``None`` for a non-tensor output) and one
    per argument (``None`` for a non-tensor one; the others in order are the DTensor arguments).
    Every mesh dim picks one pair; the combination that moves the fewest bytes runs the op on
    the local tensors."""
    from .propagation import clear_cache, decide, register
    from .propagation.strategy import expand

    def rule_of(fn: Callable[..., Any]) -> Callable[[Any], Any]:
        def rule(call: Any) -> Any:
            args, kwargs = call.spec_args()
            positions = call.tensor_positions
            options = []
            for outs, ins in fn(*args, **kwargs):
                want = [p for p in ins if p is not None]
                if len(want) != len(positions):
                    raise ValueError(f"register_sharding for {call.op}: a sharding gives {len(want)} input placements "
                                     f"(not None) for {len(positions)} DTensor arguments")
                options.append((dict(zip(positions, want)), outs[0] if len(outs) == 1 else tuple(outs)))
            if not options:
                raise call.refuse(f"with these placements: {fn.__name__} returned no sharding")
            return decide(call, expand([options] * call.mesh.ndim, positions))

        return rule

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        register(*(op if isinstance(op, (list, tuple)) else [op]))(rule_of(fn))
        clear_cache()  # decisions made under the op's former rule
        return fn

    return deco
