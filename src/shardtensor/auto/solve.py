"""Search: every plan of the space ``layout.py`` describes, priced exactly, the fastest that fits.

The space is small once repeated blocks share one decision: a role per mesh dim (batch, or TP on
at most one dim), an FSDP layout for the blocks and one for the root, and whether the root's
Linears go column-wise.  Costs add up over units -- each unit's collectives are its own, and the
activations between units are plain local tensors whatever the units chose -- so a plan's cost
is the root's (priced on the model with no block) plus ``L`` times one block's (the model with one
block, less the root's).  That is ``|roots| + |blocks|`` priced runs per role assignment, not
their product, and enumerating every combination of the priced parts is exact: no solver
relaxation or heuristic stands between the prices and the choice.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch.nn as nn

from ..comm.shapes import one_rank
from ..mesh import init_device_mesh
from ..redistribute.cost import LinkModel
from .layout import Layout, Unit
from .measure import Cost, Device, price
from .model import Blocks, cut, infer_tp_plan

__all__ = ["Priced", "Search", "search", "hand_plans"]


@dataclass(frozen=True)
class Priced:
    """A plan and its cost, split into the root's part and one block's."""

    layout: Layout
    root: Cost
    block: Cost
    count: int

    @property
    def cost(self) -> Cost:
        return self.root + self.block.times(self.count)


@dataclass
class Search:
    """What ``search`` returns: the best plan under the budget, the hand plans, what it took."""

    best: Priced
    hand: list[tuple[str, Priced]]
    plans: int
    runs: int
    seconds: float
    skipped: list[str]
    """Role assignments that cannot run (e.g. more TP ranks than heads), each with why."""


def units(batch: tuple[str, ...]) -> list[Unit]:
    """The FSDP layouts a unit may take over the batch dims named ``batch``.  HSDP takes exactly two,
    not named ``("dp", "tp")`` (which ``fully_shard`` reads as FSDP on dp with TP on tp)."""
    if not batch:
        return [Unit("none", False)]
    shards = ["full", "hybrid"] if len(batch) == 2 and "tp" not in batch else ["full"]
    return [Unit(s, r) for s in shards for r in (True, False)]


def root_units(batch: tuple[str, ...]) -> list[Unit]:
    """The root never frees its parameters after forward (FSDP's rule), so only the layout varies."""
    return [u for u in units(batch) if not u.reshard]


class _Pricer:
    """Prices layouts on cut-down copies, counting the runs."""

    def __init__(self, model: nn.Module, blocks: Blocks | None, shape: tuple[int, ...], names: tuple[str, ...],
                 inputs: tuple, loss_fn: Callable[[Any], Any], optimizer: str, device: Device,
                 links: tuple[LinkModel, ...]) -> None:
        self.blocks, self.shape, self.names = blocks, shape, names
        self.args = (inputs, loss_fn, optimizer, device, links)
        self.cuts = {k: cut(model, blocks, k) for k in ((0, 1) if blocks is not None else (0,))}
        self.runs = 0

    def __call__(self, layout: Layout, keep: int) -> Cost:
        self.runs += 1
        base = self.cuts[keep]
        return price(lambda mesh: layout.apply(copy.deepcopy(base), mesh, self.blocks, src_data_rank=None),
                     self.shape, self.names, *self.args)


def _block_args(model: nn.Module, blocks: Blocks, inputs: tuple) -> tuple[tuple, dict]:
    """The arguments the first block is called with (a plain forward of the 1-block model on meta)."""
    one = cut(model, blocks, 1)
    seen: list[tuple[tuple, dict]] = []
    blocks.of(one)[0].register_forward_pre_hook(lambda _m, a, k: seen.append((a, k)), with_kwargs=True)
    one(*inputs)
    return seen[0]


def search(model: nn.Module, blocks: Blocks | None, shape: tuple[int, ...], names: tuple[str, ...], inputs: tuple,
           loss_fn: Callable[[Any], Any], optimizer: str, device: Device, links: tuple[LinkModel, ...],
           budget: float | None) -> Search:
    """Price every plan; the one of least step time whose memory fits ``budget`` (bytes per rank)."""
    t0 = time.perf_counter()
    pricer = _Pricer(model, blocks, shape, names, inputs, loss_fn, optimizer, device, links)
    count = blocks.count if blocks is not None else 0
    block_args = _block_args(model, blocks, inputs) if blocks is not None else None
    every: list[Priced] = []
    skipped: list[str] = []
    for tp in [None, *(j for j, k in enumerate(shape) if k > 1)]:
        try:
            every += _priced(pricer, model, blocks, block_args, shape, names, tp, count)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            if tp is None:
                raise
            skipped.append(f"TP on {names[tp]} ({shape[tp]}): {str(e).splitlines()[0]}")
    fits = [p for p in every if budget is None or p.cost.memory <= budget]
    if not fits:
        least = min(every, key=lambda p: p.cost.memory)
        raise ValueError(f"autoshard: no plan fits memory_per_rank={budget:,.0f} bytes; the least memory any plan "
                         f"needs is {least.cost.memory:,.0f} bytes ({least.layout.roles()}); give more memory or "
                         "more ranks")
    best = min(fits, key=lambda p: (p.cost.step_s, p.cost.bytes))
    hand = [(name, _find(every, lay)) for name, lay in hand_plans(shape, names, every)]
    return Search(best, hand, len(every), pricer.runs, time.perf_counter() - t0, skipped)


def _priced(pricer: _Pricer, model: nn.Module, blocks: Blocks | None, block_args: tuple[tuple, dict] | None,
            shape: tuple[int, ...], names: tuple[str, ...], tp: int | None, count: int) -> list[Priced]:
    """Every plan with TP on mesh dim ``tp`` (None: none), priced by parts."""
    batch = tuple(n for j, n in enumerate(names) if j != tp)
    tp_plan: tuple[tuple[str, str], ...] = ()
    if tp is not None and blocks is not None and block_args is not None:
        with one_rank(shape[tp]):
            tp_mesh = init_device_mesh("cpu", (shape[tp],), mesh_dim_names=(names[tp],))
            tp_plan = tuple(infer_tp_plan(blocks.of(model)[0], tp_mesh, *block_args).items())
    first = Layout(shape, names, tp, units(batch)[0], root_units(batch)[0], False, tp_plan)
    roots = {(r, rt): pricer(replace(first, root=r, root_tp=rt), 0)
             for r in root_units(batch) for rt in ([False, True] if tp is not None else [False])}
    base = roots[(first.root, False)]
    per_block = {b: (pricer(replace(first, blocks=b), 1) - base) if blocks is not None else Cost()
                 for b in units(batch)}
    return [Priced(replace(first, root=r, root_tp=rt, blocks=b), rc, bc, count)
            for (r, rt), rc in roots.items() for b, bc in per_block.items()]


def _find(every: list[Priced], layout: Layout) -> Priced:
    return next(p for p in every if p.layout == layout)


def hand_plans(shape: tuple[int, ...], names: tuple[str, ...], every: list[Priced]) -> list[tuple[str, Layout]]:
    """The plans a user would write by hand, as points of the searched space."""
    by_tp = {p.layout.tp: p.layout for p in every}
    last = len(shape) - 1
    out: list[tuple[str, Layout]] = []
    fsdp = by_tp[None]
    out.append(("FSDP", replace(fsdp, blocks=Unit("full", True), root=Unit("full", False))))
    if any(p.layout.blocks.shard == "hybrid" for p in every):
        out.append(("HSDP", replace(fsdp, blocks=Unit("hybrid", True), root=Unit("hybrid", False))))
    if last in by_tp:
        tp = by_tp[last]
        if len(shape) == 1:
            out.append(("TP", replace(tp, root_tp=True)))
        else:
            batch = Unit("full", False)
            out.append(("TP + DP", replace(tp, blocks=batch, root=batch, root_tp=True)))
            out.append(("FSDP x TP", replace(tp, blocks=Unit("full", True), root=Unit("full", False), root_tp=True)))
    return out
