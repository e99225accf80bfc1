"""Batched linear algebra and pairwise distances: batch dims shard, the matrices are gathered.

| op | required inputs | outputs |
|---|---|---|
| factorizations and solves (the ``BATCHED`` list: ``_linalg_svd``, ``linalg_qr``, ``_linalg_eigh``, ``linalg_eig``, ``linalg_inv_ex``, ``_linalg_det``, ``_linalg_slogdet``, ``_linalg_solve_ex``, ``linalg_lu*``, ``linalg_cholesky_ex``, ``cholesky_solve``, ``cholesky_inverse``, ``linalg_solve_triangular``, ``linalg_matrix_exp``, ``linalg_householder_product``, ``linalg_ldl_factor_ex``, ``lu_unpack``, ...) | the first input's shards on its batch dims (all but the last two) kept, the rest gathered, partials reduced; every other tensor input at the same placements | every output the same batch shards |
| the same, when an input or output does not carry the first input's batch dims (broadcast batches) | everything ``R`` | ``R`` |
| ``_linalg_check_errors`` | the ``info`` tensor ``R`` (a few ints), so every rank raises alike | nothing |
| ``_cdist_forward`` (``x1 b p m``, ``x2 b r m`` -> ``b p r``) | per mesh dim: ``R``; batch on both; ``p`` on ``x1``; ``r`` on ``x2`` (never ``m``; partials reduced: a distance is not linear) | ``S`` of the same label |
| ``_cdist_backward`` (grad, x1, x2, cdist -> grad of ``x1``) | as the forward, grad and cdist ``b p r``; a linear partial grad kept | ``S`` of the label, ``P(sum)`` when ``r`` is sharded |

Every op of the list works matrix by matrix, so a batch shard is exact, uneven and empty pieces
included.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...placement import Placement, Replicate, Shard
from ...spec import DTensorSpec
from ..call import Call, Decision
from ..registry import register
from ..strategy import Option, decide, expand, finish, linear_partial, no_partial, replicate
from .matrix import label_options
from .misc import _ops, _renumbered, _replicate, cheapest_gather

aten = torch.ops.aten

BATCHED = ["_linalg_svd", "linalg_qr", "_linalg_eigh", "linalg_eig", "linalg_inv_ex", "_linalg_det",
           "_linalg_slogdet", "linalg_lu", "linalg_lu_factor_ex", "lu_unpack", "linalg_cholesky_ex",
           "cholesky_inverse", "linalg_matrix_exp", "linalg_householder_product", "linalg_ldl_factor_ex"]
SOLVES: dict[Any, tuple[str, bool]] = {  # the right-hand side's argument, and whether ``left`` may be set
    aten._linalg_solve_ex.default: ("B", True), aten.linalg_lu_solve.default: ("B", True),
    aten.linalg_solve_triangular.default: ("B", True), aten.linalg_ldl_solve.default: ("B", False),
    aten.cholesky_solve.default: ("self", False), aten.triangular_solve.default: ("self", False),
    aten.lu_solve.default: ("self", False), aten.ormqr.default: ("input3", True),
}
"""Solves and products ``X = op(A) B`` (or ``B op(A)`` where ``left`` is False), linear in ``B``."""


def _batch_of(call: Call) -> Callable[[Any], bool]:
    """Whether a shape carries the first input's batch dims (all but its last two)."""
    first = call.specs[call.tensor_positions[0]]
    nb = first.ndim - 2
    batch = tuple(first.shape[:nb])
    return lambda shape: len(shape) >= nb and tuple(shape[:nb]) == batch


@register(*_ops(BATCHED))
def batched_linalg_rule(call: Call) -> Decision:
    """Matrix by matrix: the first input's batch shards stay on every input and output."""
    first = call.specs[call.tensor_positions[0]]
    nb = first.ndim - 2
    req = cheapest_gather(call, call.tensor_positions[0], lambda d: d < nb, no_partial)
    metas = call.out_meta if isinstance(call.out_meta, (tuple, list)) else [call.out_meta]
    carries = _batch_of(call)

    def placeholder(m: torch.Tensor) -> bool:  # e.g. svd's empty U and V without compute_uv
        return m.numel() == 0 and not carries(m.shape)

    aligned = all(carries(call.specs[p].shape) for p in call.tensor_positions) and \
        all(m is None or carries(m.shape) or placeholder(m) for m in metas)
    if not aligned:  # broadcast batch dims: replicate everything
        req = _replicate(req)
    inputs = {p: call.specs[p].with_placements(req.placements, req.shard_order) for p in call.tensor_positions}
    rep = replicate(req.mesh.ndim)
    outs = [None if m is None else
            DTensorSpec.build(req.mesh, rep, m.shape, m.stride(), m.dtype) if placeholder(m) else
            _renumbered(req, {d: d for d in range(nb)}, m) for m in metas]
    return finish(call, inputs, tuple(outs) if isinstance(call.out_meta, (tuple, list)) else outs[0])


@register(*SOLVES)
def solve_rule(call: Call) -> Decision:
    """``X`` linear in ``B``: per mesh dim, everything ``R``; ``B``'s columns sharded (its rows
    where ``left`` is False: ``X``'s columns depend on ``B``'s alone), ``A`` whole; ``B``'s
    linear partial kept (``A`` whole; also where ``B`` broadcasts over ``A``'s batch); or a
    batch dim sharded on every input and output.  The other outputs (LU, pivots, info, the copied ``A``) depend on ``A`` alone: ``R`` unless
    the batch is sharded."""
    name, has_left = SOLVES[call.op]
    bp = call.pos(name)
    b = call.specs[bp]
    metas = list(call.out_meta) if isinstance(call.out_meta, (tuple, list)) else [call.out_meta]
    nb = call.specs[call.tensor_positions[0]].ndim - 2
    carries = _batch_of(call)
    batched = nb > 0 and all(carries(call.specs[p].shape) for p in call.tensor_positions) and \
        all(m is None or carries(m.shape) for m in metas)
    a = call.specs[next(p for p in call.tensor_positions if p != bp)]
    own = tuple(metas[0].shape) == tuple(b.shape)  # B's dims are X's
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))  # torch's test
    col = b.ndim - (1 if not has_left or call.arg("left", True) else 2)

    def outs(x: Placement, rest: Placement = Replicate()) -> Any:
        pls = tuple([x] + [rest] * (len(metas) - 1))
        return pls if isinstance(call.out_meta, (tuple, list)) else pls[0]

    per_dim = []
    for j in range(call.mesh.ndim):
        opts: list[Option] = [({}, outs(Replicate()))]
        if own and not vector:
            opts.append(({bp: Shard(col)}, outs(Shard(col))))
        if linear_partial(b.placements[j]):  # also where B broadcasts over A's batch: still linear
            opts.append(({bp: b.placements[j]}, outs(b.placements[j])))
        if batched:
            opts += [(dict.fromkeys(call.tensor_positions, Shard(d)), outs(Shard(d), Shard(d))) for d in range(nb)]
        per_dim.append(opts)
    return decide(call, expand(per_dim, list(call.tensor_positions)))


@register(aten._linalg_check_errors.default)
def check_errors_rule(call: Call) -> Decision:
    """The ``info`` codes gathered (a few ints), so that every rank raises the same error or none."""
    return finish(call, {0: _replicate(call.specs[0])}, None)


B, P, R_, M = "b", "p", "r", "m"


@register(aten._cdist_forward.default, needs=("x1", "x2"))
def cdist_rule(call: Call) -> Decision:
    """Distances row by row: batch, ``x1``'s rows or ``x2``'s rows shard; the feature dim never."""
    x1, x2 = call.pos("x1"), call.pos("x2")
    nb = call.specs[x1].ndim - 2
    if call.specs[x2].ndim - 2 != nb or tuple(call.specs[x1].shape[:nb]) != tuple(call.specs[x2].shape[:nb]):
        raise call.refuse("with broadcast batch dims")
    batch = tuple((B, d) for d in range(nb))
    operands = [(x1, batch + (P, M)), (x2, batch + (R_, M))]
    options = label_options(call, operands, [(batch + (P, R_), [x1, x2])], batch + (P, R_), linear=[])
    return decide(call, expand(options, [x1, x2]))


@register(aten._cdist_backward.default, needs=("grad", "x1", "x2", "cdist"))
def cdist_backward_rule(call: Call) -> Decision:
    """Grad of ``x1``: summed over ``x2``'s rows, so ``P(sum)`` where those are sharded."""
    g, x1, x2, c = call.pos("grad"), call.pos("x1"), call.pos("x2"), call.pos("cdist")
    nb = call.specs[x1].ndim - 2
    if call.specs[x2].ndim - 2 != nb or tuple(call.specs[x1].shape[:nb]) != tuple(call.specs[x2].shape[:nb]):
        raise call.refuse("with broadcast batch dims")
    batch = tuple((B, d) for d in range(nb))
    operands = [(g, batch + (P, R_)), (x1, batch + (P, M)), (x2, batch + (R_, M)), (c, batch + (P, R_))]
    options = label_options(call, operands, [(batch + (P, M), [g, x1, x2, c])], batch + (P, R_), linear=[g])
    return decide(call, expand(options, [g, x1, x2, c]))
