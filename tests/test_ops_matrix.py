"""Matrix products (mm, bmm, addmm, baddbmm, mv, addmv, dot, matmul, linear) and embedding.

Differential checks against dense torch (forward and backward) over random placement combos,
on meshes (4,) and (2, 2), with lengths 7 and 3 on every sharded dim; explicit placement and
communication assertions for the interesting candidates; one gloo run.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from opcheck import MESHES, check, data, gen, local_piece, partial_terms, placement_combos  # noqa: E402

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh, run_spmd  # noqa: E402

aten = torch.ops.aten
R, P, PA = Replicate(), Partial("sum"), Partial("avg")


def combos(values, mesh, partial, limit: int, seed=0) -> list:
    """Random placement combos with at most one Partial kind per tensor (what opcheck can build)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    ok = placement_combos(tensors, mesh, None, seed, partial)  # never mixes Partial kinds on one tensor
    if len(ok) <= limit:
        return ok
    rng = random.Random(repr((seed, mesh)))
    picked = rng.sample(ok, limit)
    allr = tuple(tuple(R for _ in mesh) for _ in tensors)
    return picked if allr in picked else picked[:-1] + [allr]


def rand(shape, seed) -> torch.Tensor:
    return data("any", shape, gen((seed, shape)))


KINDS = ("sum", "avg", "max")


# ----------------------------------------------------------------------------- products


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("mkn", [(8, 6, 4), (7, 3, 5)])
def test_mm(mesh, mkn):
    m, k, n = mkn
    a, b = rand((m, k), "a"), rand((k, n), "b")
    seen = check(torch.mm, [a, b], mesh, combos=combos([a, b], mesh, KINDS, 24 if len(mesh) == 1 else 16))
    for (pa, pb), out in seen:
        if len(mesh) == 1 and pa == (Shard(1),) and pb == (Shard(0),):
            assert out == (P,)


@pytest.mark.parametrize("mesh", MESHES)
def test_bmm(mesh):
    a, b = rand((3, 7, 4), "a"), rand((3, 4, 5), "b")
    check(torch.bmm, [a, b], mesh, combos=combos([a, b], mesh, ("sum", "avg"), 12))


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("bias_shape", [(5,), (7, 5), (7, 1)])
def test_addmm(mesh, bias_shape):
    bias, a, b = rand(bias_shape, "c"), rand((7, 3), "a"), rand((3, 5), "b")
    check(lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2.0), [bias, a, b], mesh,
          combos=combos([bias, a, b], mesh, ("sum", "avg"), 12, seed=bias_shape))


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("bias_shape", [(3, 7, 5), (7, 1)])
def test_baddbmm(mesh, bias_shape):
    bias, a, b = rand(bias_shape, "c"), rand((3, 7, 4), "a"), rand((3, 4, 5), "b")
    check(lambda c, x, y: torch.baddbmm(c, x, y, beta=0.5, alpha=-1.5), [bias, a, b], mesh,
          combos=combos([bias, a, b], mesh, ("sum",), 10, seed=bias_shape))


@pytest.mark.parametrize("mesh", MESHES)
def test_mv_dot_addmv(mesh):
    a, v, w, c = rand((7, 3), "a"), rand((3,), "v"), rand((3,), "w"), rand((7,), "c")
    check(torch.mv, [a, v], mesh, combos=combos([a, v], mesh, KINDS, 12))
    check(torch.dot, [v, w], mesh, combos=combos([v, w], mesh, KINDS, 12))
    check(lambda c, a, v: torch.addmv(c, a, v, beta=2.0), [c, a, v], mesh,
          combos=combos([c, a, v], mesh, ("sum",), 8))


def test_mm_int():
    a = torch.randint(-3, 4, (7, 3), generator=gen(1))
    b = torch.randint(-3, 4, (3, 5), generator=gen(2))
    check(torch.mm, [a, b], (4,), limit=None, partial=("sum",), grad=False)


# ----------------------------------------------------------------------------- composites (need view rules)


MATMUL_SHAPES = [((3,), (3,)), ((7, 3), (3,)), ((3,), (3, 5)), ((3,), (2, 3, 5)),
                 ((7, 3), (3, 5)), ((2, 7, 3), (3, 5)), ((2, 7, 3), (2, 3, 5)), ((2, 1, 7, 3), (3, 3, 5)),
                 ((3,), (2, 3, 5))]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=lambda s: f"{s[0]}@{s[1]}")
def test_matmul(mesh, shapes):
    a, b = rand(shapes[0], "a"), rand(shapes[1], "b")
    check(torch.matmul, [a, b], mesh, combos=combos([a, b], mesh, ("sum",), 8, seed=shapes))


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("x_shape", [(7, 3), (2, 7, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(mesh, x_shape, bias):
    x, w = rand(x_shape, "x"), rand((5, 3), "w")
    values = [x, w] + ([rand((5,), "b")] if bias else [])
    check(F.linear, values, mesh, combos=combos(values, mesh, ("sum",), 10, seed=(x_shape, bias)))


# ----------------------------------------------------------------------------- placements and communication


def _run(mesh_shape, body):
    n = 1
    for s in mesh_shape:
        n *= s
    return run_spmd(lambda: body(init_device_mesh("cpu", mesh_shape)), n)


def make(t: torch.Tensor, mesh, placements) -> DTensor:
    """``t`` as a DTensor with ``placements`` (Partial ones built from random per-rank terms)."""
    src = t
    terms = partial_terms(t, mesh.shape, placements, gen(("terms", tuple(t.shape))))
    coord = mesh.get_coordinate()
    if terms is not None:
        src = terms[tuple(c for c, p in zip(coord, placements) if isinstance(p, Partial))]
    local = local_piece(src, mesh.shape, coord, placements)
    return DTensor.from_local(local, mesh, list(placements), shape=t.shape, stride=t.stride())


def n_collectives(log) -> int:
    """Collectives this rank took part in."""
    return sum(1 for e in log.events if e.rank == comm.current_transport().rank)


@pytest.mark.parametrize("pa,pb,want", [
    ((Shard(1),), (Shard(0),), (P,)),
    ((Shard(0),), (R,), (Shard(0),)),
    ((R,), (Shard(1),), (Shard(1),)),
    ((P,), (R,), (P,)),
    ((R,), (PA,), (PA,)),
    ((R,), (R,), (R,)),
    ((Shard(1), Shard(0)), (Shard(0), R), (P, Shard(0))),
    ((Shard(0), Shard(1)), (R, Shard(0)), (Shard(0), P)),
    ((Shard(0), Shard(0)), (R, R), (Shard(0), Shard(0))),
    ((Shard(1), P), (Shard(0), R), (P, P)),
])
def test_mm_placements_no_comm(pa, pb, want):
    """Candidates that need no data movement are taken as they are, with zero collectives."""
    a, b = rand((7, 6), "a"), rand((6, 5), "b")
    mesh_shape = (4,) if len(pa) == 1 else (2, 2)

    def body(mesh):
        x, y = make(a, mesh, pa), make(b, mesh, pb)
        with comm.recording() as log:
            out = torch.mm(x, y)
        return out.placements, n_collectives(log), out.full_tensor()

    for placements, n_events, full in _run(mesh_shape, body):
        assert placements == want
        assert n_events == 0
        torch.testing.assert_close(full, a @ b)


def test_mm_cost_selection():
    """With both operands sharded, the cheaper operand is the one gathered."""
    small_a = (rand((64, 8), "a"), rand((8, 512), "b"))
    small_b = (rand((512, 8), "a"), rand((8, 64), "b"))

    def body(mesh):
        outs = []
        for a, b in (small_a, small_b):
            x = distribute_tensor(a, mesh, [Shard(0)])
            y = distribute_tensor(b, mesh, [Shard(1)])
            out = torch.mm(x, y)
            outs.append((out.placements, torch.equal(out.full_tensor(), a @ b)))
        return outs

    for (pl1, ok1), (pl2, ok2) in _run((4,), body):
        assert ok1 and ok2
        assert pl1 == (Shard(1),)  # A is 512 elements: gather A, keep B's columns
        assert pl2 == (Shard(0),)  # B is 512 elements: gather B, keep A's rows


def test_addmm_partial_output_bias_partitioned():
    """A row/column split product is Partial(sum); a replicated bias joins it without communication."""
    c, a, b = rand((5,), "c"), rand((7, 6), "a"), rand((6, 5), "b")

    def body(mesh):
        bias = distribute_tensor(c, mesh, [R])
        x = distribute_tensor(a, mesh, [Shard(1)])
        y = distribute_tensor(b, mesh, [Shard(0)])
        with comm.recording() as log:
            out = torch.addmm(bias, x, y, beta=3.0)
        return out.placements, n_collectives(log), out.full_tensor()

    for pl, n, full in _run((4,), body):
        assert pl == (P,) and n == 0
        torch.testing.assert_close(full, torch.addmm(c, a, b, beta=3.0))


def test_bmm_batch_and_nested_order():
    """bmm keeps a batch shard; a nested non-default shard order carries to the output."""
    a, b = rand((4, 7, 3), "a"), rand((4, 3, 5), "b")

    def body(mesh):
        x = distribute_tensor(a, mesh, [R, R]).redistribute(mesh, [Shard(0), Shard(0)], shard_order={0: [1, 0]})
        y = distribute_tensor(b, mesh, [R, R])
        out = torch.bmm(x, y)
        want_local = local_piece(a @ b, mesh.shape, mesh.get_coordinate(), out.placements, ((0, (1, 0)),))
        return out.placements, out.shard_order, out.full_tensor(), torch.equal(out.to_local(), want_local)

    for pl, order, full, local_ok in _run((2, 2), body):
        assert pl == (Shard(0), Shard(0)) and order == ((0, (1, 0)),)
        assert local_ok
        torch.testing.assert_close(full, a @ b)


def test_mm_nested_contraction_orders_agree():
    """Both operands nested on k with different orders: one is reordered, the Partial is right."""
    a, b = rand((5, 7), "a"), rand((7, 3), "b")

    def body(mesh):
        x = distribute_tensor(a, mesh, [R, R]).redistribute(mesh, [Shard(1), Shard(1)], shard_order={1: [1, 0]})
        y = distribute_tensor(b, mesh, [Shard(0), Shard(0)])
        out = torch.mm(x, y)
        return out.placements, out.full_tensor()

    for pl, full in _run((2, 2), body):
        assert pl == (P, P)
        torch.testing.assert_close(full, a @ b)


# ----------------------------------------------------------------------------- embedding


def emb(w, i):
    return F.embedding(i, w)


def emb_pad(w, i):
    return F.embedding(i, w, padding_idx=1)


def emb_freq(w, i):
    return F.embedding(i, w, scale_grad_by_freq=True)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("fn,vocab,dim,ishape", [
    (emb, 7, 3, (5, 3)), (emb, 8, 6, (4,)), (emb, 3, 5, (7, 2)),
    (emb_pad, 7, 3, (5, 3)), (emb_freq, 3, 5, (7, 2)), (emb_freq, 8, 6, (4,)),
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_embedding(mesh, fn, vocab, dim, ishape):
    w = rand((vocab, dim), "w")
    i = torch.randint(0, vocab, ishape, generator=gen((vocab, ishape)))
    i.view(-1)[0] = 1
    limit = 24 if len(mesh) == 1 else 16
    check(fn, [w, i], mesh, combos=combos([w, i], mesh, [("sum", "avg", "max"), ("sum",)], limit, seed=ishape))


@pytest.mark.parametrize("wp,ip,want", [
    ((Shard(0),), (R,), (P,)),
    ((Shard(1),), (R,), (Shard(2),)),
    ((R,), (Shard(0),), (Shard(0),)),
    ((R,), (Shard(1),), (Shard(1),)),
    ((Partial("max"),), (R,), (Partial("max"),)),
    ((Shard(0), Shard(1)), (R, R), (P, Shard(2))),
    ((Shard(0), R), (R, Shard(0)), (P, Shard(0))),
    ((Shard(0), Shard(0)), (R, R), (P, P)),
])
def test_embedding_placements_no_comm(wp, ip, want):
    """Row-wise weight gives Partial(sum); column-wise S(last); batch indices S(d); no collectives."""
    w = rand((7, 4), "w")
    i = torch.tensor([[0, 6, 3], [5, 1, 6], [2, 2, 4]])
    mesh_shape = (4,) if len(wp) == 1 else (2, 2)

    def body(mesh):
        x, idx = make(w, mesh, wp), make(i, mesh, ip)
        with comm.recording() as log:
            out = F.embedding(idx, x)
        return out.placements, n_collectives(log), out.full_tensor()

    for pl, n, full in _run(mesh_shape, body):
        assert pl == want and n == 0
        torch.testing.assert_close(full, F.embedding(i, w))


@pytest.mark.parametrize("gp,ip,want", [
    ((Shard(0),), (Shard(0),), (P,)),
    ((Shard(2),), (R,), (Shard(1),)),
    ((P,), (R,), (P,)),
    ((R,), (R,), (R,)),
])
def test_embedding_backward_placements(gp, ip, want):
    """Batch-sharded grads give a Partial(sum) weight grad; an emb-sharded grad gives S(1)."""
    g = rand((3, 2, 4), "g")
    i = torch.tensor([[0, 6], [5, 1], [6, 6]])
    dense = aten.embedding_dense_backward(g, i, 7, -1, False)

    def body(mesh):
        gd, idx = make(g, mesh, gp), make(i, mesh, ip)
        with comm.recording() as log:
            out = aten.embedding_dense_backward(gd, idx, 7, -1, False)
        return out.placements, n_collectives(log), out.full_tensor()

    for pl, n, full in _run((4,), body):
        assert pl == want and n == 0
        torch.testing.assert_close(full, dense)


def test_embedding_rowwise_grad_accumulates_and_updates():
    """A row-wise weight: two backward passes accumulate; an SGD-style update keeps S(0)."""
    w = rand((7, 4), "w")
    i = torch.tensor([[0, 6, 3], [5, 1, 6]])
    gw = rand((2, 3, 4), "gw")
    ref = w.clone().requires_grad_()
    for _ in range(2):
        (F.embedding(i, ref) * gw).sum().backward()
    updated = w - 0.1 * ref.grad

    def body(mesh):
        x = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        idx = distribute_tensor(i, mesh, [R])
        for _ in range(2):
            out = F.embedding(idx, x)
            assert out.placements == (P,)
            (out.full_tensor() * gw).sum().backward()
        grad = x.grad.full_tensor()
        with torch.no_grad():
            x.add_(x.grad, alpha=-0.1)
        return x.placements, grad, x.full_tensor()

    for pl, grad, new in _run((4,), body):
        assert pl == (Shard(0),)
        torch.testing.assert_close(grad, ref.grad)
        torch.testing.assert_close(new, updated)


# ----------------------------------------------------------------------------- gloo


def emb_then_mm(w, i, b):
    return torch.mm(F.embedding(i, w), b)


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
def test_gloo_embedding_and_mm():
    w, i, b = rand((7, 4), "w"), torch.tensor([0, 6, 3, 5, 1, 6, 2]), rand((4, 3), "b")
    cases = [((Shard(0),), (R,), (R,)), ((R,), (Shard(0),), (Shard(1),)), ((Shard(1),), (R,), (Shard(0),)),
             ((P,), (R,), (R,))]
    seen = check(emb_then_mm, [w, i, b], (4,), combos=cases, world="gloo")
    assert [out for _, out in seen] == [(P,), (Shard(0),), (P,), (P,)]
