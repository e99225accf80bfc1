"""fully_shard with ragged data-parallel layouts (``shard_placement_fn`` -> ``RaggedShard(0, ...)``).

Training must equal one device (the harness of test_fsdp) and, since the same elements are
reduced in the same rank order, be bit-for-bit the run with FSDP's usual ``Shard(0)``; the
gradients come back with the parameters' ragged placements; a wrong layout is refused, naming
the parameter, and leaves the module as it was.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from distributed import gloo_available, run_multiprocess
from test_fsdp import (WORLD, _tp_build, _tp_reference, assert_matches, batch, build, loss_fn, rank_train, reference,
                       tp_train)

from shardtensor import DTensor, RaggedShard, Replicate, Shard, StridedShard, comm, init_device_mesh, run_spmd
from shardtensor.fsdp import (MixedPrecisionPolicy, block_aligned, deal_largest_first, fully_shard,
                              whole_parameters)


def _uneven(world: int):
    """2-D weights on uneven units (one rank empty), everything else Shard(0)."""
    def fn(p: nn.Parameter):
        return RaggedShard(0, [(r * 2 + 1) % 3 for r in range(world)]) if p.ndim == 2 else None
    return fn


def _fn(layout: str, module: nn.Module, world: int):
    if layout == "whole":
        return whole_parameters(module, world)
    if layout == "blocks":
        return block_aligned(world, block=8)
    if layout == "uneven":
        return _uneven(world)
    return None


def _wrap(kind: str, model: nn.Module, mesh, layout: str, **kw) -> nn.Module:
    subs = [model.l1, model.l2, model.l3] if kind == "mlp" else list(model.blocks)
    W = mesh.size(mesh.ndim - 1)
    for s in subs:
        fully_shard(s, mesh=mesh, shard_placement_fn=_fn(layout, s, W), **kw)
    return fully_shard(model, mesh=mesh, shard_placement_fn=_fn(layout, model, W), **kw)


def _rank_train(kind: str, opt: str, layout: str, steps: int = 3, **kw):
    """FSDP training on this rank's slice of the batch: its losses, the full parameters, and
    per parameter (placements, local shape, gradient placements) after the first step."""
    seen: dict = {}

    def look(model: nn.Module) -> None:
        seen.update({} if seen else {
            name: (p.placements, tuple(p.to_local().shape), p.grad.placements, tuple(p.grad.to_local().shape))
            for name, p in model.named_parameters()})
    losses, params = rank_train(kind, opt, steps, wrapper=lambda k, m, mesh: _wrap(k, m, mesh, layout, **kw),
                                on_grads=look)
    return losses, params, seen


@pytest.mark.parametrize("kind", ["mlp", "tiny"])
@pytest.mark.parametrize("layout", ["whole", "blocks", "uneven"])
def test_ragged_fsdp_trains_as_one_device_and_as_shard_0_bit_for_bit(kind, layout):
    out = run_spmd(_rank_train, WORLD, kind, "adam", layout)
    assert_matches([(lo, ps) for lo, ps, _ in out], reference(kind, "adam", 3))
    even = run_spmd(_rank_train, WORLD, kind, "adam", "even")
    for (lo, ps, _), (lo2, ps2, _) in zip(out, even):
        assert lo == lo2
        assert all(torch.equal(ps[n], ps2[n]) for n in ps)
    ragged = 0
    for rank, (_, _, seen) in enumerate(out):
        for name, (pl, local, gpl, glocal) in seen.items():
            assert gpl == pl and glocal == local, name  # the gradient has its parameter's layout
            if pl[0] != Shard(0):
                ragged += 1
                full = dict(build(kind).named_parameters())[name].shape
                size, _ = pl[0].pieces(full[0], WORLD, rank)[0]
                assert local == (size, *full[1:]), (name, local)
    assert ragged > 0


def test_whole_parameters_puts_each_parameter_on_one_rank_and_the_muon_step_moves_nothing():
    def body():
        mesh = init_device_mesh("cpu", (WORLD,))
        model = build("tiny")
        fully_shard(model, mesh=mesh, shard_placement_fn=whole_parameters(model, WORLD))
        me = mesh.get_rank()
        holders = {}
        for name, p in model.named_parameters():
            full = p.shape[0]
            holders[name] = [r for r in range(WORLD) if p.placements[0].pieces(full, WORLD, r)[0][0] == full]
        with comm.recording() as log:
            for p in model.parameters():  # a whole-matrix op on each parameter's holder: no data moves
                if p.to_local().numel() == p.numel() and p.ndim == 2:
                    torch.linalg.qr(p.to_local().detach())
        return holders, [e for e in log.events if e.rank == me]
    out = run_spmd(body, WORLD)
    holders, events = out[0]
    assert all(len(h) == 1 for h in holders.values()), holders
    assert all(not ev for _, ev in out)
    loads = [0] * WORLD
    for name, p in build("tiny").named_parameters():
        loads[holders[name][0]] += p.numel()
    assert max(loads) - min(loads) <= max(p.numel() for p in build("tiny").parameters())  # dealt largest first


def test_block_aligned_cuts_only_between_blocks():
    fn = block_aligned(4, block=128)
    for shape in [(1000,), (37, 100), (3, 5, 7), (512, 256), (1,), (0, 4)]:
        p = nn.Parameter(torch.empty(shape))
        pl = fn(p)
        row = math.prod(shape[1:])
        starts = [pl.pieces(shape[0], 4, r)[0][1] * row for r in range(4)]
        sizes = [pl.pieces(shape[0], 4, r)[0][0] for r in range(4)]
        assert sum(sizes) == shape[0]
        assert all(s % 128 == 0 or s == p.numel() for s in starts), (shape, starts)
    # 1000 elements = 8 blocks (the last short): 2 per rank
    assert [block_aligned(4)(nn.Parameter(torch.empty(1000))).pieces(1000, 4, r)[0][0] for r in range(4)] == \
        [256, 256, 256, 232]
    assert deal_largest_first([5, 9, 1, 4], 2) == [1, 0, 0, 1]  # 9 -> 0, 5 -> 1, 4 -> 1, 1 -> 0 (a tie: the lower)
    with pytest.raises(ValueError, match="block"):
        block_aligned(4, block=0)
    with pytest.raises(ValueError, match="world"):
        whole_parameters(nn.Linear(2, 2), 0)


def test_mixed_precision_and_mixed_dtypes_are_bit_for_bit_shard_0():
    class Two(nn.Module):  # a float32 and a float64 weight: the all-gather travels as bytes
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(5)
            self.a = nn.Parameter(torch.randn(9, 4, generator=g))
            self.b = nn.Parameter(torch.randn(7, 4, generator=g, dtype=torch.float64))
            self.c = nn.Parameter(torch.randn(3, generator=g))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ self.a.T).sum(-1) + (x.to(self.b.dtype) @ self.b.T).sum(-1).to(x.dtype) + self.c.sum()

    def body(layout: str, mp: bool):
        mesh = init_device_mesh("cpu", (WORLD,))
        m = Two()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else \
            MixedPrecisionPolicy()
        fn = {"even": None, "whole": whole_parameters(m, WORLD), "uneven": _uneven(WORLD)}[layout]
        fully_shard(m, mesh=mesh, shard_placement_fn=fn, mp_policy=policy)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(mesh.get_rank()))
        for _ in range(2):
            (m(x.bfloat16() if mp else x).float() ** 2).sum().backward()
            o.step()
            o.zero_grad()
        return {n: p.full_tensor() for n, p in m.named_parameters()}
    for mp in (False, True):  # bytes (float32 + float64), then one cast dtype (bf16 compute)
        want = run_spmd(body, WORLD, "even", mp)
        for layout in ("whole", "uneven"):
            got = run_spmd(body, WORLD, layout, mp)
            for g, w in zip(got, want):
                assert all(torch.equal(g[n], w[n]) for n in w), (layout, mp)


def test_gradient_accumulation_and_keeping_the_unsharded_parameters():
    def body(layout: str):
        mesh = init_device_mesh("cpu", (WORLD,))
        m = _wrap("mlp", build("mlp"), mesh, layout)
        m.set_reshard_after_backward(False)
        r = mesh.get_rank()
        for s in range(3):
            x, y = batch("mlp", s)
            m.set_requires_gradient_sync(s == 2)
            loss_fn("mlp", m, x[r * 2:(r + 1) * 2], y[r * 2:(r + 1) * 2]).backward()
        return {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    want = run_spmd(body, WORLD, "even")
    got = run_spmd(body, WORLD, "uneven")
    for g, w in zip(got, want):
        assert all(torch.equal(g[n], w[n]) for n in w)


def _tp_ragged(steps: int, form: str):
    """torch's 2-D recipe with ragged dp pieces of the TP-local dim 0 (FSDP x TP on (2, 2)), or
    HSDP on (2, 2) with ragged pieces over its shard dim."""
    from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = ("dp", "tp") if form == "2d" else ("rep", "shard")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    model = _tp_build()
    if form == "2d":
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"], shard_placement_fn=lambda p: RaggedShard(0, (1, 2)))
        part = mesh.get_local_rank("dp")
        parts = 2
    else:
        fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: RaggedShard(0, (0, 1)) if p.ndim == 2 else None)
        part, parts = mesh.get_rank(), 4
    losses = tp_train(model, steps, part, parts)
    layout = {n: p.placements for n, p in model.named_parameters()}
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}, layout


@pytest.mark.parametrize("form", ["2d", "hsdp"])
def test_ragged_dp_under_tp_and_hsdp(form):
    pytest.importorskip("shardtensor.parallel")
    out = run_spmd(_tp_ragged, WORLD, 3, form)
    assert_matches([(r[0], r[1]) for r in out], _tp_reference(3), tol=1e-5)
    layout = out[0][2]
    if form == "2d":
        assert layout["up.weight"] == (RaggedShard(0, (1, 2)), Shard(0))
    else:
        assert layout["up.weight"] == (Replicate(), RaggedShard(0, (0, 1)))
        assert layout["norm.weight"] == (Replicate(), Shard(0))


def test_bad_layouts_are_refused_naming_the_parameter_and_change_nothing():
    def body(fn, match, err):
        model = build("mlp")
        with pytest.raises(err, match=match):
            fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)), shard_placement_fn=fn)
        assert not isinstance(model.l1.weight, DTensor)
    cases = [(lambda p: RaggedShard(0, (1, 1)), r"Linear\.weight.*2 pieces for a mesh dim of 4", ValueError),
             (lambda p: Shard(1), r"Shard\(dim=1\).*Linear\.weight|Linear\.weight.*dim 0", NotImplementedError),
             (lambda p: StridedShard(0, 2), "one run per rank", NotImplementedError),
             (lambda p: "S0", "return a placement", TypeError),
             (3, "callable", TypeError)]
    for fn, match, err in cases:
        run_spmd(body, WORLD, fn, match, err)


def _gloo_rank(rank: int, world: int):
    out = _rank_train("tiny", "adam", "uneven", 2)
    return out[0], {n: p.tolist() for n, p in out[1].items()}


@pytest.mark.skipif(not gloo_available(), reason="needs gloo")
def test_ragged_fsdp_in_gloo_processes():
    res = run_multiprocess(_gloo_rank, WORLD, timeout=180)
    assert_matches([(lo, {n: torch.tensor(v) for n, v in ps.items()}) for lo, ps in res], reference("tiny", "adam", 2))


def _ckpt(path: str, save_layout: str, load_layout: str):
    from shardtensor.checkpoint import load, save

    mesh = init_device_mesh("cpu", (WORLD,))
    src = _wrap("tiny", build("tiny"), mesh, save_layout)
    save(src.state_dict(), checkpoint_id=path)
    dst = _wrap("tiny", build("tiny"), mesh, load_layout)
    with torch.no_grad():
        for p in dst.parameters():
            p.to_local().fill_(7)
    sd = dst.state_dict()
    load(sd, checkpoint_id=path)
    want = dict(build("tiny").named_parameters())
    return [n for n, p in dst.named_parameters() if not torch.equal(p.full_tensor(), want[n].detach())]


@pytest.mark.parametrize("save_layout,load_layout", [("whole", "even"), ("even", "uneven"), ("blocks", "whole")])
def test_a_ragged_fsdp_checkpoint_loads_into_another_layout_exactly(tmp_path, save_layout, load_layout):
    assert run_spmd(_ckpt, WORLD, str(tmp_path / "ckpt"), save_layout, load_layout) == [[]] * WORLD


def test_clip_grad_norm_over_ragged_gradients_equals_shard_0():
    def body(layout: str):
        mesh = init_device_mesh("cpu", (WORLD,))
        m = _wrap("tiny", build("tiny"), mesh, layout)
        x, y = batch("tiny", 0)
        loss_fn("tiny", m, x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm, \
            {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    want = run_spmd(body, WORLD, "even")
    for layout in ("whole", "uneven"):
        for (n1, g1), (n2, g2) in zip(run_spmd(body, WORLD, layout), want):
            torch.testing.assert_close(n1, n2, rtol=1e-6, atol=0)
            assert all(torch.allclose(g1[k], g2[k], rtol=1e-6, atol=1e-9) for k in g2)


def test_whole_parameters_deals_only_what_this_fully_shard_manages():
    def body():
        mesh = init_device_mesh("cpu", (WORLD,))
        model = build("tiny")
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh, shard_placement_fn=whole_parameters(blk, WORLD))
        fn = whole_parameters(model, WORLD)
        with pytest.raises(ValueError, match="not one of the module's"):
            fn(model.blocks[0].fc1.weight)  # a child's: dealt by the child's own call
        fully_shard(model, mesh=mesh, shard_placement_fn=fn)
        own = [model.emb.weight, model.pos, model.ln_f.weight, model.ln_f.bias, model.head.weight, model.head.bias]
        loads = [0] * WORLD
        for p in own:
            pl = p.placements[0]
            holder = [r for r in range(WORLD) if pl.pieces(p.shape[0], WORLD, r)[0][0] == p.shape[0]]
            loads[holder[0]] += p.numel()
        return loads
    loads = run_spmd(body, WORLD)[0]
    assert sorted(loads) == sorted(deal_largest_first_loads([132, 84, 12, 12, 132, 11], WORLD)), loads


def deal_largest_first_loads(sizes: list[int], k: int) -> list[int]:
    loads = [0] * k
    for s, r in zip(sizes, deal_largest_first(sizes, k)):
        loads[r] += s
    return loads
