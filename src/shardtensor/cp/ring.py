"""Ring attention over a sequence-sharded group: each rank keeps its queries, key/value blocks travel.

Forward: at step ``t`` rank ``i`` holds the keys and values of rank ``i - t`` (mod P); it hands them
to rank ``i + 1`` (asynchronously, while it computes on them) and merges the block's result into
its running output with the log-sum-exp update.  Each rank receives ``P - 1`` blocks, the
analytic minimum for attention that keeps queries in place, and holds at most two blocks.
Backward: the blocks travel the same ring again, each with the running sum of its key/value
gradients; after ``P`` hops that sum comes home complete.

``method="gather"`` (torch's ``set_rotate_method("allgather")``) receives every block at once (the
same bytes, the whole sequence's keys and values in memory) and sends each block's gradient home
in one exchange.  What each block computes comes from the ``SeqLayout``'s pairs of runs: runs
that see nothing are skipped (their keys still travel), full and causal-triangle runs use torch's
fused CPU kernel where it applies (``blocks.fusable``), the rest plain math.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import comm
from .blocks import acc_dtype, attend, attend_backward, fusable, grouped, merge, ungrouped
from .layout import Pair, SeqLayout

__all__ = ["RingPlan", "ring_attention"]

KV = tuple[torch.Tensor, ...]


@dataclass(eq=False)
class RingPlan:
    """What one ring attention call needs besides its tensors."""

    mesh: Any
    mesh_dim: Any
    layout: SeqLayout
    causal: bool
    scale: float
    method: str = "ring"
    me: int = 0
    size: int = 1
    fused: bool = False
    pairs_of: dict[int, list[Pair]] = field(default_factory=dict)

    def pairs(self, src: int) -> list[Pair]:
        """What this rank's queries compute against rank ``src``'s keys (built once per call)."""
        if src not in self.pairs_of:
            self.pairs_of[src] = self.layout.pairs(self.me, src, self.causal)
        return self.pairs_of[src]


def _shapes(ts: KV, n: int) -> list[tuple[int, ...]]:
    """The shapes of another rank's tensors like ``ts`` holding ``n`` positions (dim -2)."""
    return [(*t.shape[:-2], n, t.shape[-1]) for t in ts]


def _unpack(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
    sizes = [math.prod(s) for s in shapes]
    return tuple(p.view(s) for p, s in zip(flat.split(sizes), shapes))


def _exchange(sends: dict[int, KV], recv: dict[int, list[tuple[int, ...]]],
              like: torch.Tensor, plan: RingPlan) -> Any:
    """One all-to-all: ``sends[j]`` to group rank ``j``; a ``Work`` giving {j: tensors from ``j``}."""
    empty = like.new_empty(0)
    flat = [torch.cat([t.reshape(-1) for t in sends[j]]) if j in sends else empty for j in range(plan.size)]
    shapes: list[tuple[int, ...]] = [(sum(math.prod(s) for s in recv[j]),) if j in recv else (0,)
                                     for j in range(plan.size)]
    work = comm.all_to_all_v(flat, shapes, plan.mesh, plan.mesh_dim, async_op=True)
    return work.then(lambda out: {j: _unpack(out[j], recv[j]) for j in recv})


def _pass_on(ts: KV, src: int, plan: RingPlan) -> Any:
    """Send ``ts`` to the next rank, receive from the previous one (which holds block ``src - 1``)."""
    prev, nxt = (plan.me - 1) % plan.size, (plan.me + 1) % plan.size
    incoming = _shapes(ts, plan.layout.count((src - 1) % plan.size))
    return _exchange({nxt: ts}, {prev: incoming}, ts[0], plan).then(lambda got: got[prev])


def _gather(ts: KV, plan: RingPlan) -> dict[int, KV]:
    """Every rank's ``ts`` (this rank's own included), by group rank."""
    others = [j for j in range(plan.size) if j != plan.me]
    got = _exchange(dict.fromkeys(others, ts), {j: _shapes(ts, plan.layout.count(j)) for j in others},
                    ts[0], plan).wait()
    return {**got, plan.me: ts}


def _sources(plan: RingPlan) -> list[int]:
    return [(plan.me - t) % plan.size for t in range(plan.size)]


def _as_kv(k: torch.Tensor, grouped_q: bool, dtype: torch.dtype) -> torch.Tensor:
    k = k.to(dtype)
    return k.unsqueeze(2) if grouped_q else k


def _rows(t: torch.Tensor, s: slice) -> torch.Tensor:
    return t[..., s, :]


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan,
             gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in the accumulation dtype, log-sum-exp), queries grouped when ``gqa``."""
    acc = acc_dtype(q.dtype)
    qa = grouped(q.to(acc), k.shape[1]) if gqa else q.to(acc)
    out = qa.new_zeros((*qa.shape[:-1], v.shape[-1]))
    lse = qa.new_full(qa.shape[:-1], float("-inf"))
    blocks = _gather((k, v), plan) if plan.method == "gather" else None
    cur: KV = (k, v)
    for t, src in enumerate(_sources(plan)):
        if blocks is not None:
            cur = blocks[src]
        work = _pass_on(cur, src, plan) if blocks is None and t < plan.size - 1 else None
        kk, vv = _as_kv(cur[0], gqa, acc), _as_kv(cur[1], gqa, acc)
        for p in plan.pairs(src):
            o, lo = attend(_rows(qa, p.qs), _rows(kk, p.ks), _rows(vv, p.ks), p, plan.scale, plan.fused)
            out[..., p.qs, :], lse[..., p.qs] = merge(_rows(out, p.qs), lse[..., p.qs], o, lo)
        if work is not None:
            cur = work.wait()
    return out, lse


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, plan: RingPlan, gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): blocks travel the ring again, each with its running gradient sum."""
    acc = acc_dtype(q.dtype)
    kv_heads = k.shape[1]
    qa = grouped(q.to(acc), kv_heads) if gqa else q.to(acc)
    da = grouped(dout.to(acc), kv_heads) if gqa else dout.to(acc)
    oa = grouped(out.to(acc), kv_heads) if gqa else out.to(acc)
    delta = (da * oa).sum(-1)
    dq = torch.zeros_like(qa)
    blocks = _gather((k, v), plan) if plan.method == "gather" else None
    grads: dict[int, KV] = {}
    cur: KV = (k, v)
    run: KV = ()
    for t, src in enumerate(_sources(plan)):
        if blocks is not None:
            cur = blocks[src]
        work = _pass_on(cur, src, plan) if blocks is None and t < plan.size - 1 else None
        kk, vv = _as_kv(cur[0], gqa, acc), _as_kv(cur[1], gqa, acc)
        dk, dv = torch.zeros(cur[0].shape, dtype=acc, device=k.device), torch.zeros(cur[1].shape, dtype=acc,
                                                                                  device=k.device)
        for p in plan.pairs(src):
            dq_b, dk_b, dv_b = attend_backward(_rows(qa, p.qs), _rows(kk, p.ks), _rows(vv, p.ks), p, plan.scale,
                                               plan.fused, _rows(oa, p.qs), lse[..., p.qs], _rows(da, p.qs),
                                               delta[..., p.qs])
            dq[..., p.qs, :] += dq_b
            dk[..., p.ks, :] += dk_b.reshape(_rows(dk, p.ks).shape)
            dv[..., p.ks, :] += dv_b.reshape(_rows(dv, p.ks).shape)
        if blocks is not None:
            grads[src] = (dk, dv)
            continue
        run = (dk, dv) if t == 0 else (run[0] + dk, run[1] + dv)
        home = _pass_on(run, src, plan) if plan.size > 1 else None
        if work is not None:
            cur = work.wait()
        if home is not None:
            run = home.wait()
    if blocks is not None:
        run = _send_home(grads, k, v, acc, plan)
    dq = ungrouped(dq) if gqa else dq
    return dq.to(q.dtype), run[0].to(k.dtype), run[1].to(v.dtype)


def _send_home(grads: dict[int, KV], k: torch.Tensor, v: torch.Tensor, acc: torch.dtype, plan: RingPlan) -> KV:
    """Each block's gradient to the rank that owns the block, summed there (``gather`` backward);
    a block this rank's queries saw nothing of sends zeros (every pair exchanges once)."""
    def zeros(j: int) -> KV:
        return tuple(torch.zeros(s, dtype=acc, device=k.device) for s in _shapes((k, v), plan.layout.count(j)))

    others = [j for j in range(plan.size) if j != plan.me]
    got = _exchange({j: grads.get(j) or zeros(j) for j in others},
                    dict.fromkeys(others, [tuple(k.shape), tuple(v.shape)]), k.to(acc), plan).wait()
    total = grads.get(plan.me) or zeros(plan.me)
    for j in others:
        total = (total[0] + got[j][0], total[1] + got[j][1])
    return total


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan,  # type: ignore[override]
                gqa: bool) -> torch.Tensor:
        out, lse = _forward(q, k, v, plan, gqa)
        out = (ungrouped(out) if gqa else out).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.gqa = plan, gqa
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        return (*_backward(dout, q, k, v, out, lse, ctx.plan, ctx.gqa), None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: Any, mesh_dim: Any,
                   layout: SeqLayout, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False, method: str = "ring") -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, whose pieces the ranks of
    ``mesh``'s ``mesh_dim`` group hold as ``layout`` says (plain local tensors in and out)."""
    if method not in ("ring", "gather"):
        raise ValueError(f"method must be 'ring' or 'gather', got {method!r}")
    group = mesh.group_ranks(mesh_dim)
    if len(group) != layout.ranks:
        raise ValueError(f"layout has {layout.ranks} pieces for a group of {len(group)} ranks")
    me = group.index(mesh.get_rank())
    n = layout.count(me)
    if q.shape[-2] != n or k.shape[-2] != n or v.shape[-2] != n:
        raise ValueError(f"context-parallel attention: this rank holds {n} of the {layout.length} sequence "
                         f"positions, but query/key/value have {q.shape[-2]}/{k.shape[-2]}/{v.shape[-2]} "
                         "(self-attention over the sharded sequence only)")
    lead = q.shape[:-2]
    if k.shape[:-2] != v.shape[:-2] or (q.ndim != 4 and k.shape[:-2] != lead):
        raise ValueError(f"query, key and value need matching leading dims, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    gqa = q.ndim == 4 and q.shape[1] != k.shape[1]
    if gqa and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        raise ValueError(f"query has {q.shape[1]} heads and key {k.shape[1]}: pass enable_gqa=True with "
                         "query heads a multiple of key heads")
    plan = RingPlan(mesh, mesh_dim, layout, bool(is_causal), q.shape[-1] ** -0.5 if scale is None else float(scale),
                    method, me, len(group), fused=not gqa and fusable(q, k, v))
    if q.ndim != 4:
        flat = (1, math.prod(lead), n)
        out = _RingAttention.apply(q.reshape(*flat, q.shape[-1]), k.reshape(*flat, k.shape[-1]),
                                   v.reshape(*flat, v.shape[-1]), plan, False)
        return out.reshape(*lead, n, v.shape[-1])
    return _RingAttention.apply(q, k, v, plan, gqa)
