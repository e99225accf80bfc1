"""Rules for scatters and lookups that ran through the replicate fallback before: index_reduce,
put, masked_scatter, diagonal_scatter, searchsorted/bucketize and embedding_bag.  Values and
gradients against one device on many placements; shardings kept without the fallback."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opcheck import MESHES, check, data, gen

from shardtensor import Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh, run_spmd, strict_sharding

R, S0, S1, PS, PMAX = Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("max")


def _outputs(seen) -> set:
    return {outs for _, outs in seen}


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(mesh, reduce, include_self):
    g = gen(("index_reduce", reduce, include_self))
    x, src = data("any", (5, 6), g), data("any", (7, 6), g)
    index = torch.randint(0, 5, (7,), generator=g)
    kinds = {"prod": "product", "mean": "sum", "amax": "max", "amin": "min"}[reduce]
    seen = check(lambda a, i, b: a.index_reduce(0, i, b, reduce, include_self=include_self), [x, index, src], mesh,
                 limit=16, partial=[(kinds,), (), (kinds,)], tol={"rtol": 1e-4, "atol": 1e-4})
    assert len(seen) == 16


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("accumulate", [True, False])
def test_put(mesh, accumulate):
    g = gen(("put", accumulate))
    x, src = data("any", (5, 6), g), data("any", (3, 3), g)
    index = torch.randperm(30, generator=g)[:9].reshape(3, 3)  # distinct places: no write races
    check(lambda a, i, b: a.put(i, b, accumulate=accumulate), [x, index, src], mesh, limit=16,
          partial=[("sum", "max"), (), ("sum", "max")])


@pytest.mark.parametrize("mesh", MESHES)
def test_masked_scatter(mesh):
    g = gen("masked_scatter")
    x, src = data("any", (5, 6), g), data("any", (31,), g)
    mask = torch.rand(5, 6, generator=g) > 0.4
    check(lambda a, m, b: a.masked_scatter(m, b), [x, mask, src], mesh, limit=16,
          partial=[("sum", "max"), ("max",), ("sum", "max")])
    # a broadcast mask
    row = torch.rand(6, generator=g) > 0.5
    check(lambda a, m, b: a.masked_scatter(m, b), [x, row, src], mesh, limit=8)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("offset,dim1,dim2", [(0, 0, 1), (1, 0, 2), (-2, 2, 0)])
def test_diagonal_scatter(mesh, offset, dim1, dim2):
    g = gen(("diagonal_scatter", offset, dim1, dim2))
    x = data("any", (5, 3, 6), g)
    src = torch.diagonal(x, offset, dim1, dim2).clone().normal_(generator=g)
    check(lambda a, b: torch.diagonal_scatter(a, b, offset, dim1, dim2), [x, src], mesh, limit=20,
          partial=[("sum", "max"), ("sum", "max")])


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("right", [False, True])
def test_searchsorted_and_bucketize(mesh, right):
    g = gen(("searchsorted", right))
    seq = torch.arange(-3.0, 3.0, 0.5)
    batched = torch.sort(data("any", (5, 7), g), dim=-1).values
    values = data("any", (5, 6), g)
    check(lambda s, v: torch.searchsorted(s, v, right=right), [seq, values], mesh, limit=12)
    check(lambda s, v: torch.searchsorted(s, v, right=right), [batched, values], mesh, limit=12)
    check(lambda v, s: torch.bucketize(v, s, right=right), [values, seq], mesh, limit=12)
    shuffled = torch.randperm(7, generator=g)
    rows = batched[:, shuffled].contiguous()
    sorter = torch.argsort(rows, dim=-1)
    check(lambda s, v, o: torch.searchsorted(s, v, sorter=o), [rows, values, sorter], mesh, limit=12)


def test_sharded_boundaries_count_their_own_piece():
    """A value's bucket is the number of boundaries below it: with the boundaries sharded each
    rank counts in its sorted piece and the output is ``P(sum)``, with no communication."""
    seq, values = torch.arange(-3.0, 3.0, 0.5), data("any", (5, 6), gen("bucket"))

    def body():
        mesh = init_device_mesh("cpu", (4,))
        s = distribute_tensor(seq, mesh, [Shard(0)])
        v = distribute_tensor(values, mesh, [Replicate()])
        with comm.recording() as log:
            b, p = torch.bucketize(v, s, right=True), torch.searchsorted(s, v)
        return b.placements, p.placements, len(log.of_rank(mesh.get_rank())), b.full_tensor(), p.full_tensor()
    for bp, pp, n, b, p in run_spmd(body, 4):
        assert bp == pp == (Partial(),) and n == 0
        assert torch.equal(b, torch.bucketize(values, seq, right=True)) and torch.equal(p, torch.searchsorted(seq, values))


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag(mesh, mode):
    g = gen(("embedding_bag", mode))
    weight = data("any", (10, 6), g)
    indices = torch.randint(0, 10, (9,), generator=g)
    offsets = torch.tensor([0, 2, 2, 5])  # an empty bag included
    psw = data("any", (9,), g) if mode == "sum" else None
    if psw is None:
        fn = lambda i, w, o: F.embedding_bag(i, w, o, mode=mode)  # noqa: E731
        values = [indices, weight, offsets]
    else:
        fn = lambda i, w, o, p: F.embedding_bag(i, w, o, mode=mode, per_sample_weights=p)  # noqa: E731
        values = [indices, weight, offsets, psw]
    check(fn, values, mesh, limit=16)


def test_new_rules_keep_shards_and_partials_without_fallback():
    def body():
        mesh = init_device_mesh("cpu", (4,))
        g = gen("no-fallback")
        x = distribute_tensor(data("any", (8, 6), g), mesh, [S1])
        src = distribute_tensor(data("any", (5, 6), g), mesh, [S1])
        index = distribute_tensor(torch.randint(0, 8, (5,), generator=g), mesh, [R])
        p = distribute_tensor(data("any", (8, 6), g), mesh, [PMAX])
        q = distribute_tensor(data("any", (48,), g), mesh, [PMAX])
        mask = distribute_tensor(torch.rand(8, 6, generator=g) > 0.5, mesh, [R])
        seq = distribute_tensor(torch.arange(10.0), mesh, [R])
        w = distribute_tensor(data("any", (10, 8), g), mesh, [S1])
        bags = distribute_tensor(torch.tensor([1, 2, 3, 9, 0]), mesh, [R])
        offs = distribute_tensor(torch.tensor([0, 3]), mesh, [R])
        diag = distribute_tensor(data("any", (8, 6), g), mesh, [S0])
        with strict_sharding():
            outs = [x.index_reduce(0, index, src, "amax"), p.masked_scatter(mask, q),
                    torch.searchsorted(seq, x), torch.bucketize(x, seq),
                    F.embedding_bag(bags, w, offs, mode="max"),
                    torch.diagonal_scatter(distribute_tensor(data("any", (4, 8, 8), g), mesh, [S0]),
                                           distribute_tensor(data("any", (4, 8), g), mesh, [S0]), 0, 1, 2),
                    p.put(distribute_tensor(torch.tensor([1, 7]), mesh, [R]),
                          distribute_tensor(data("any", (2,), g), mesh, [PMAX])),
                    diag.masked_fill(mask, 0.0)]
        return [tuple(o.placements) for o in outs]

    for r in run_spmd(body, 4):
        assert r == [(S1,), (PMAX,), (S1,), (S1,), (S1,), (S0,), (PMAX,), (S0,)], r
