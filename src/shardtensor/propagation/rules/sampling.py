"""Grid sampling (``F.grid_sample``): output points read the input where the grid says.

Labels (2-D; 3-D adds a spatial dim to each): input ``n c h w``, grid ``n i j t``, output
``n c i j``.  Per mesh dim: ``R``; the batch ``n`` on input and grid; the channels ``c`` on
the input; the output points ``i``, ``j`` on the grid; never the input's spatial dims (a point
may read anywhere) nor the grid's coordinates ``t``.  The output is linear in the input (fixed
interpolation weights), so a linear Partial input is kept.

Backward (grad ``n c i j``): the input's gradient sums over the output points, so it is
``P(sum)`` where ``i``/``j`` are sharded; the grid's gradient sums over the channels, ``P(sum)``
where ``c`` is.  Both are linear in the incoming gradient.
"""
from __future__ import annotations

import torch

from ..call import Call, Decision
from ..registry import register
from ..strategy import decide, expand
from .matrix import label_options

aten = torch.ops.aten

N, C, T = "n", "c", "t"


def _labels(call: Call) -> tuple[tuple, tuple, tuple, list]:
    """(input, grid, output) labels for the sampler's spatial rank, and the shardable ones."""
    k = call.specs[call.pos("input")].ndim - 2
    space, points = tuple(f"s{d}" for d in range(k)), tuple(f"o{d}" for d in range(k))
    return (N, C) + space, (N,) + points + (T,), (N, C) + points, [N, C, *points]


@register(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default, needs=("input", "grid"))
def grid_sampler_rule(call: Call) -> Decision:
    inp, grid = call.pos("input"), call.pos("grid")
    li, lg, lo, shardable = _labels(call)
    options = label_options(call, [(inp, li), (grid, lg)], [(lo, [inp, grid])], shardable, linear=[inp])
    return decide(call, expand(options, [inp, grid]))


@register(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default,
          needs=("grad_output", "input", "grid"))
def grid_sampler_backward_rule(call: Call) -> Decision:
    g, inp, grid = call.pos("grad_output"), call.pos("input"), call.pos("grid")
    li, lg, lo, shardable = _labels(call)
    operands = [(g, lo), (inp, li), (grid, lg)]
    options = label_options(call, operands, [(li, [g, grid]), (lg, [g, inp])], shardable, linear=[g])
    return decide(call, expand(options, [g, inp, grid]))
