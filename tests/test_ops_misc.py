"""Differential tests: linalg, diagonals, triangles, upsampling, equal/item, random ops, and the
pointwise clamp/where/masked_fill family (rules/misc.py; the last ones come from the pointwise tag)."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from opcheck import MESHES, check, data, gen, local_piece  # noqa: E402

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh, run_spmd  # noqa: E402


def _same_placements(seen) -> None:
    for ins, out in seen:
        assert out == ins[0], f"input {ins[0]} gave {out}"


# -- triangles ---------------------------------------------------------------------------

def tril_2(a):
    return torch.tril(a, 2)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("shape", [(7, 7), (3, 5), (2, 7, 5)])
def test_tril_triu(mesh, shape):
    x = data("any", shape, gen(("tri", shape)))
    for t in (-1, 0, 2):
        _same_placements(check(lambda a: torch.tril(a, t), [x], mesh, partial=("max",), limit=4, seed=("l", t)))
        _same_placements(check(lambda a: a.triu(diagonal=t), [x], mesh, partial=("sum",), limit=4, seed=("u", t)))


def test_tril_row_and_column_sharded_moves_nothing():
    x = torch.arange(49.0).reshape(7, 7)

    def body(pl):
        mesh = init_device_mesh("cpu", (2, 2))
        d = distribute_tensor(x, mesh, pl)
        with comm.recording() as log:
            y = torch.tril(d, -1)
            z = torch.triu(d, 2)
        return len(log.of_rank(mesh.get_rank())), y.placements, y.full_tensor(), z.full_tensor()

    for pl in ([Shard(0), Shard(1)], [Shard(1), Shard(1)], [Shard(0), Shard(0)]):
        for n, out_pl, y, z in run_spmd(body, 4, pl):
            assert n == 0 and out_pl == tuple(pl)
            assert torch.equal(y, torch.tril(x, -1)) and torch.equal(z, torch.triu(x, 2))


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
def test_tril_gloo():
    x = data("any", (7, 5), gen("gloo-tril"))
    combos = [((Shard(0),),), ((Shard(1),),), ((Partial("sum"),),)]
    seen = check(tril_2, [x], (4,), combos=combos, world="gloo")
    _same_placements(seen)


# -- diagonals ---------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
def test_diagonal(mesh):
    m = data("any", (7, 5), gen("diag2"))
    b = data("any", (3, 7, 5), gen("diag3"))
    for off in (-1, 1):
        check(lambda a: torch.diagonal(a, off), [m], mesh, partial=("max",), limit=6, seed=off)
    seen = check(lambda a: torch.diagonal(a, -1, 1, 2), [b], mesh, partial=("sum",), limit=8)
    for ins, out in seen:
        for p, q in zip(ins[0], out):
            if p == Shard(0):
                assert q == Shard(0)
    seen = check(lambda a: torch.diagonal_copy(a, 1, 2, 0), [b], mesh, partial=("sum",), limit=8)
    for ins, out in seen:
        for p, q in zip(ins[0], out):
            if p == Shard(1):
                assert q == Shard(0)


@pytest.mark.parametrize("mesh", MESHES)
def test_diag_and_diag_embed(mesh):
    v = data("any", (7,), gen("v"))
    m = data("any", (7, 5), gen("m"))
    check(lambda a: torch.diag(a, 1), [v], mesh, partial=("sum",), limit=6)
    check(lambda a: torch.diag(a, -1), [m], mesh, partial=("sum",), limit=6)
    b = data("any", (3, 7), gen("e"))
    seen = check(lambda a: torch.diag_embed(a, 1, 0, 2), [b], mesh, partial=("sum",), limit=8)
    for ins, out in seen:
        for p, q in zip(ins[0], out):
            if p == Shard(0):
                assert q == Shard(1)
    check(lambda a: torch.diag_embed(a, -1), [data("any", (2, 3, 4), gen("e3"))], mesh, partial=("max",), limit=6)


def test_trace_of_row_sharded_matrix():
    m = data("any", (7, 7), gen("trace"))
    check(lambda a: torch.trace(a), [m], (4,), combos=[((Shard(0),),), ((Shard(1),),)], grad=False)


# -- linalg ------------------------------------------------------------------------------

def _sign_aligned(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    s = torch.sign((a * e).sum(-2, keepdim=True))
    return a * torch.where(s == 0, torch.ones_like(s), s)


def _close(a, e):
    torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh", MESHES)
def test_linalg_batch_shards(mesh):
    x = data("any", (3, 7, 5), gen("svd"))
    seen = check(lambda a: torch.linalg.svd(a, full_matrices=False), [x], mesh, limit=6, grad=False,
                 compare=lambda a, e, k: _close(a if k == 1 else _sign_aligned(a, e), e))
    for ins, outs in seen:  # batch shards kept; a matrix dim's shard gathered or moved to the batch (the cheaper)
        assert all(o == outs[0] for o in outs), (ins, outs)
        assert all(p == Shard(0) if q == Shard(0) else p in (Shard(0), Replicate())
                   for p, q in zip(outs[0], ins[0])), (ins, outs)
    check(lambda a: torch.linalg.qr(a), [x], mesh, limit=6, grad=False,
          compare=lambda a, e, k: _close(a if k == 1 else _sign_aligned(a, e), e))
    s = data("any", (3, 5, 5), gen("eigh"))
    check(lambda a: torch.linalg.eigh(a), [s], mesh, limit=6, grad=False,
          compare=lambda a, e, k: _close(_sign_aligned(a, e) if k == 1 else a, e))


def test_svd_reconstruction_backward():
    x = data("any", (3, 7, 5), gen("svd-bw"))

    def recon(a):
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        return (u * s.unsqueeze(-2)) @ vh

    check(recon, [x], (4,), limit=4, partial=("sum",), tol=dict(rtol=1e-4, atol=1e-4))


# -- upsampling --------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
def test_upsample(mesh):
    x1 = data("any", (7, 3, 4), gen("u1"))
    x2 = data("any", (7, 3, 4, 5), gen("u2"))
    cases = [
        (lambda a: F.interpolate(a, scale_factor=2, mode="linear"), x1, "sum"),
        (lambda a: F.interpolate(a, size=(5, 3), mode="nearest"), x2, "max"),
        (lambda a: F.interpolate(a, scale_factor=1.5, mode="bilinear", align_corners=True), x2, "sum"),
        (lambda a: F.interpolate(a, size=(3, 7), mode="bicubic"), x2, "avg"),
    ]
    for i, (fn, x, kind) in enumerate(cases):
        seen = check(fn, [x], mesh, partial=(kind,), limit=4, seed=i, tol=dict(rtol=1e-4, atol=1e-5))
        for ins, out in seen:
            for p, q in zip(ins[0], out):
                if p in (Shard(0), Shard(1)):
                    assert q == p


def test_upsample_trilinear_batch_of_three():
    x = data("any", (3, 2, 2, 3, 2), gen("u3"))
    check(lambda a: F.interpolate(a, scale_factor=2, mode="trilinear"), [x], (4,),
          combos=[((Shard(0),),), ((Shard(1),),), ((Shard(3),),), ((Partial("sum"),),)])


# -- equal / item ------------------------------------------------------------------------

def test_equal_and_item():
    x = data("any", (7, 3), gen("eq"))
    y = x.clone()
    y[6, 2] += 1

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        out = []
        for pa, pb in [([Shard(0), Shard(1)], [Shard(0), Shard(1)]), ([Shard(0), Replicate()], [Replicate(), Shard(1)]),
                       ([Replicate(), Replicate()], [Replicate(), Replicate()])]:
            a = distribute_tensor(x, mesh, pa)
            out.append((torch.equal(a, distribute_tensor(x, mesh, pb)), torch.equal(a, distribute_tensor(y, mesh, pb))))
        a = distribute_tensor(x, mesh, [Shard(0), Replicate()])
        out.append(torch.equal(a, distribute_tensor(x[:, :2].contiguous(), mesh, [Shard(0), Replicate()])))
        p = DTensor.from_local(torch.tensor(1.5 + mesh.get_rank()), mesh, [Partial("sum"), Partial("sum")])
        out.append(p.item())
        out.append(a.sum().item())
        return out

    for r in run_spmd(body, 4):
        assert r[:3] == [(True, False)] * 3 and r[3] is False
        assert r[4] == 1.5 * 4 + 6
        assert r[5] == pytest.approx(x.sum().item(), abs=1e-5)


# -- random ------------------------------------------------------------------------------

PLACEMENTS = [[Replicate(), Replicate()], [Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Shard(1)]]


def _random_body(kind: str):
    mesh = init_device_mesh("cpu", (2, 2))
    out = []
    for pl in PLACEMENTS:
        d = distribute_tensor(torch.zeros(7, 3), mesh, pl)
        g = torch.Generator().manual_seed(11)
        torch.manual_seed(5)
        if kind == "uniform_":
            r = d.uniform_(-1, 2, generator=g)
        elif kind == "normal_":
            r = d.normal_(3.0, 2.0, generator=g)
        elif kind == "bernoulli_":
            r = d.bernoulli_(0.3, generator=g)
        elif kind == "rand_like":
            r = torch.rand_like(d)
        elif kind == "randn_like":
            r = torch.randn_like(d)
        elif kind == "randint_like":
            r = torch.randint_like(d, 2, 9)
        else:
            r = torch.bernoulli(distribute_tensor(torch.full((7, 3), 0.5), mesh, pl))
        out.append((r.placements, r.to_local().clone(), r.full_tensor()))
    return out


@pytest.mark.parametrize("kind", ["uniform_", "normal_", "bernoulli_", "rand_like", "randn_like", "randint_like",
                                  "bernoulli"])
def test_random_same_for_every_placement(kind):
    res = run_spmd(_random_body, 4, kind)
    ref = res[0][0][2]
    assert ref.std() > 0
    for rank, per in enumerate(res):
        coord = (rank // 2, rank % 2)
        for pl, (out_pl, local, full) in zip(PLACEMENTS, per):
            assert out_pl == tuple(pl)
            assert torch.equal(full, ref)
            assert torch.equal(local, local_piece(ref, (2, 2), coord, pl))


def test_random_fill_of_partial_keeps_its_placements_and_like_replicates_partial():
    """A fill overwrites: a Partial tensor keeps its placements and memory (its views see the
    draw), the value is one device's draw split into terms; ``rand_like`` of a Partial is Replicate."""
    def body(kind):
        mesh = init_device_mesh("cpu", (2, 2))
        p = DTensor.from_local(torch.ones(3, 2), mesh, [Partial(kind), Shard(1)])
        v = p.view(12)
        torch.manual_seed(5)
        p.uniform_()
        q = DTensor.from_local(torch.zeros(3, 4), mesh, [Partial(kind), Replicate()])
        q.bernoulli_(distribute_tensor(torch.full((3, 4), 0.5), mesh, [Replicate(), Replicate()]))
        return p.placements, p.full_tensor(), v.full_tensor(), q.placements, q.full_tensor(), torch.rand_like(p).placements

    torch.manual_seed(5)
    want = torch.empty(3, 4).uniform_()
    for kind in ("sum", "max", "avg"):
        for pl, full, view, qpl, q, like in run_spmd(body, 4, kind):
            assert pl == (Partial(kind), Shard(1)) and torch.equal(full, want) and torch.equal(view, want.view(12))
            assert qpl == (Partial(kind), Replicate()) and bool(((q == 0) | (q == 1)).all())
            assert like == (Replicate(), Shard(1))


# -- pointwise family (rules/pointwise.py) -----------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
def test_clamp_where_masked_fill(mesh):
    x = data("any", (7, 3), gen("cl"))
    lo = data("any", (7, 3), gen("lo"))
    mask = data("bool", (7, 3), gen("mask"))
    check(lambda a: torch.clamp(a, -0.5, 0.5), [x], mesh, partial=("sum",), limit=8)
    check(lambda a: a.clamp_min(0.25), [x], mesh, partial=("max",), limit=8, seed=1)
    check(lambda a: a.clamp_max(-0.25), [x], mesh, partial=("sum",), limit=8, seed=2)
    check(lambda a, b: torch.clamp(a, min=b), [x, lo], mesh, partial=("sum",), limit=10, seed=3)
    check(lambda m, a, b: torch.where(m, a, b), [mask, x, lo], mesh, partial=("sum",), limit=12, seed=4)
    check(lambda a, m: a.masked_fill(m, 2.0), [x, mask], mesh, partial=("sum",), limit=10, seed=5)
    x3 = data("any", (3, 5), gen("cl3"))
    check(lambda a: torch.where(a > 0, a, 0.0), [x3], mesh, partial=("sum",), limit=8, seed=6)
