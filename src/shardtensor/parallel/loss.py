"""``loss_parallel()``: cross-entropy on class-sharded logits without gathering them.

As ``torch.distributed.tensor.parallel.loss_parallel``: inside the context,
``F.cross_entropy(x, target)`` with ``x`` a DTensor sharded on its class dim (dim 1, or dim 0
of a 1-D input), e.g. the output of a ``ColwiseParallel`` head with ``use_local_output=False``,
works on per-row statistics:

- forward: one all-reduce (max) of the rows' maxima and one (sum) of the rows' sums of
  exponentials stacked with the target logits (and the label-smoothing term), over the mesh
  dims that shard the classes;
- backward: no collective: the gradient is softmax minus one-hot, from the saved statistics.

Other mesh dims may shard the batch; the target follows the logits' placements without the
class dim.  A plain target or weight is the whole tensor on every rank.  Probability targets and
logits not sharded on the class dim take the ordinary path (with plain target and weight taken
as replicated values).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import comm
from ..mesh import DeviceMesh
from ..placement import Placement, Replicate, Shard, shard_dim, unpartial
from ..tensor import DTensor, distribute_tensor

__all__ = ["loss_parallel"]


@contextmanager
def loss_parallel() -> Iterator[None]:
    """Within the block, ``F.cross_entropy`` on class-sharded DTensor logits gathers nothing."""
    with _LossParallelMode():
        yield


class _LossParallelMode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            out = _cross_entropy(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def _cross_entropy(input: Any, target: Any, weight: Any = None, size_average: Any = None, ignore_index: int = -100,
                   reduce: Any = None, reduction: str = "mean", label_smoothing: float = 0.0) -> Any:
    if not isinstance(input, DTensor) or not isinstance(target, torch.Tensor):
        return NotImplemented
    c = 1 if input.ndim >= 2 else 0
    class_dims = tuple(j for j, p in enumerate(input.placements) if p.is_shard(c))
    if not class_dims or input._spec.opaque or target.is_floating_point() or \
            tuple(target.shape) != tuple(input.shape[:c]) + tuple(input.shape[c + 1:]):
        mesh = input.device_mesh  # the ordinary path, with plain target and weight as replicated values
        target, weight = (distribute_tensor(a, mesh, [Replicate()] * mesh.ndim, src_data_rank=None)
                          if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in (target, weight))
        return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    mesh = input.device_mesh
    x = _without_partial(input)
    t = _target_like(target, x.placements, c, mesh)
    n_classes = input.shape[c]
    w = weight.full_tensor() if isinstance(weight, DTensor) else weight
    (_, off) = x._spec.local_shape_and_offset()
    nll, smooth, wt = _ShardedCrossEntropy.apply(x.to_local(), t.to_local(), w, off[c], c, n_classes, ignore_index,
                                                 label_smoothing > 0, mesh, class_dims)
    as_dt = [DTensor.from_local(v, mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
             for v in (nll, smooth, wt)]
    nll, smooth, wt = as_dt
    loss = nll * wt if w is not None else nll
    if label_smoothing > 0:
        loss = (1 - label_smoothing) * loss + (label_smoothing / n_classes) * smooth
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / wt.sum()


def _without_partial(x: DTensor) -> DTensor:
    pl = unpartial(x.placements)
    return x if pl == tuple(x.placements) else x.redistribute(x.device_mesh, pl)


def _target_like(target: torch.Tensor, placements: tuple[Placement, ...], c: int, mesh: DeviceMesh) -> DTensor:
    """The target placed as the logits without their class dim (replicated where classes are sharded)."""
    dims = [shard_dim(p) for p in placements]
    pl = [Shard(d - (d > c)) if d is not None and d != c else Replicate() for d in dims]
    if isinstance(target, DTensor):
        return target if tuple(target.placements) == tuple(pl) else target.redistribute(mesh, pl)
    return distribute_tensor(target, mesh, pl, src_data_rank=None)


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per-element ``(nll, smoothing term, target weight)`` of the local logits' rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t: torch.Tensor, weight: torch.Tensor | None, off: int, c: int,
                n_classes: int, ignore_index: int, smoothing: bool, mesh: DeviceMesh, dims: tuple[int, ...]) -> tuple:
        group = dims[0] if len(dims) == 1 else dims
        acc = torch.promote_types(x.dtype, torch.float32)
        xa = x.detach().to(acc)
        n = x.shape[c]
        row_max = xa.amax(c, keepdim=True) if n else torch.full_like(xa.sum(c, keepdim=True), -torch.inf)
        z = xa - comm.all_reduce(row_max, "max", mesh, group)
        valid = t != ignore_index
        local_t = t - off
        mine = valid & (local_t >= 0) & (local_t < n)
        idx = local_t.clamp(0, max(n - 1, 0)).unsqueeze(c)
        shape = [1] * x.ndim
        shape[c] = n
        w_local = None if weight is None else weight.to(acc).narrow(0, off, n).view(shape)
        rows = [z.exp().sum(c), (z.gather(c, idx).squeeze(c) if n else torch.zeros_like(t, dtype=acc)) * mine]
        if smoothing:
            rows.append((z if w_local is None else z * w_local).sum(c))
        sums = comm.all_reduce(torch.stack(rows), "sum", mesh, group)
        lse = sums[0].log()
        nll = (lse - sums[1]) * valid
        total_w = n_classes if weight is None else weight.to(acc).sum()  # a tensor: no host sync
        smooth = (total_w * lse - sums[2]) * valid if smoothing else torch.zeros_like(nll)
        if weight is None:
            wt = valid.to(acc)
        else:
            wt = weight.to(acc)[t.clamp(0, weight.numel() - 1)] * valid
        ctx.save_for_backward(z, lse, idx, mine, valid)
        ctx.c, ctx.w_local, ctx.total_w, ctx.dtype = c, w_local, total_w, x.dtype
        ctx.mark_non_differentiable(wt)
        return nll.to(x.dtype), smooth.to(x.dtype), wt.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g_nll: torch.Tensor | None, g_smooth: torch.Tensor | None, _g_wt: Any) -> tuple:
        z, lse, idx, mine, valid = ctx.saved_tensors
        c = ctx.c
        p = (z - lse.unsqueeze(c)).exp()
        grad = torch.zeros_like(p)
        if g_nll is not None and p.shape[c]:
            onehot = torch.zeros_like(p).scatter_(c, idx, mine.unsqueeze(c).to(p.dtype))
            grad += (g_nll.to(p.dtype) * valid).unsqueeze(c) * (p - onehot)
        if g_smooth is not None:
            w = 1.0 if ctx.w_local is None else ctx.w_local
            grad += (g_smooth.to(p.dtype) * valid).unsqueeze(c) * (p * ctx.total_w - w)
        return grad.to(ctx.dtype), *[None] * 9
