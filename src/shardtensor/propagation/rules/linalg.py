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

from typing import Any

import torch

from ...spec import DTensorSpec
from ..call import Call, Decision
from ..registry import register
from ..strategy import decide, expand, finish, no_partial, replicate
from .matrix import label_options
from .misc import _ops, _renumbered, _replicate, gather_dims

aten = torch.ops.aten

BATCHED = ["_linalg_svd", "linalg_qr", "_linalg_eigh", "linalg_eig", "linalg_inv_ex", "_linalg_det",
           "_linalg_slogdet", "_linalg_solve_ex", "linalg_lu", "linalg_lu_factor_ex", "linalg_lu_solve",
           "lu_unpack", "linalg_cholesky_ex", "cholesky_solve", "cholesky_inverse", "linalg_solve_triangular",
           "triangular_solve", "linalg_matrix_exp", "linalg_householder_product", "ormqr",
           "linalg_ldl_factor_ex", "linalg_ldl_solve"]


@register(*_ops(BATCHED))
def batched_linalg_rule(call: Call) -> Decision:
    """Matrix by matrix: the first input's batch shards stay on every input and output."""
    first = call.specs[call.tensor_positions[0]]
    nb = first.ndim - 2
    batch = tuple(first.shape[:nb])
    req = gather_dims(first, lambda d: d < nb, no_partial)
    metas = call.out_meta if isinstance(call.out_meta, (tuple, list)) else [call.out_meta]

    def carries(shape: Any) -> bool:
        return len(shape) >= nb and tuple(shape[:nb]) == batch

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
