"""Indexing ops (rules/indexing.py): flip, roll, gather, scatter*, index_add, index, index_put,
data-dependent ops, and the backward formulas of other families that go through them."""
from __future__ import annotations

import math

import pytest
import torch

from opcheck import MESHES, check, data, gen, run_recorded  # noqa: E402

from shardtensor import strict_sharding  # noqa: E402
from shardtensor import (DTensor, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh,  # noqa: E402
                         run_spmd)

S0, S1, R = Shard(0), Shard(1), Replicate()


def _perm_index(n: int, shape: tuple[int, ...], dim: int, g: torch.Generator) -> torch.Tensor:
    """Index of ``shape`` with values in ``[0, n)``, distinct along ``dim`` (no duplicate writes)."""
    moved = list(shape)
    m = moved.pop(dim)
    rows = 1
    for s in moved:
        rows *= s
    idx = torch.stack([torch.randperm(n, generator=g)[:m] for _ in range(rows)])
    return idx.reshape(*moved, m).movedim(-1, dim).contiguous()


def _rand_index(n: int, shape, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, n, shape, generator=g)




# -- flip / roll --------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("dims", [(0,), (1,), (0, -1)])
def test_flip(mesh, dims):
    x = data("any", (7, 3), gen(("flip", dims)))
    seen = check(lambda t: torch.flip(t, dims), [x], mesh, partial=("sum", "max"), limit=10)
    for (pl,), out in seen:
        flipped = {d % 2 for d in dims}
        exp = tuple(R if isinstance(p, Shard) and p.dim in flipped else p for p in pl)
        assert out == exp


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("shifts,dims", [(2, 0), ((1, -4), (0, 1)), (3, None)])
def test_roll(mesh, shifts, dims):
    x = data("any", (7, 3), gen(("roll", shifts)))
    fn = (lambda t: torch.roll(t, shifts)) if dims is None else (lambda t: torch.roll(t, shifts, dims))
    seen = check(fn, [x], mesh, partial=("sum",), limit=10)
    rolled = {0, 1} if dims is None else {d % 2 for d in ((dims,) if isinstance(dims, int) else dims)}
    for (pl,), out in seen:
        assert out == tuple(R if isinstance(p, Shard) and p.dim in rolled else p for p in pl)


# -- gather ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("xshape,ishape,dim", [((7, 3), (7, 3), 0), ((7, 3), (3, 3), 0), ((7, 3), (7, 2), 1),
                                               ((3, 7), (2, 7), 0)])
def test_gather(mesh, xshape, ishape, dim):
    g = gen(("gather", xshape, ishape, dim))
    x = data("any", xshape, g)
    idx = _rand_index(xshape[dim], ishape, g)
    check(lambda t, i: torch.gather(t, dim, i), [x, idx], mesh, partial=[("sum", "max"), ("sum",)], limit=9)


def _placed(mesh, pairs):
    """DTensors without communication; a Partial(sum) value is split evenly, other kinds repeat it."""
    out = []
    for v, p in pairs:
        if any(isinstance(q, Partial) for q in p):
            local = v / mesh.size() if any(q == Partial("sum") for q in p) else v
            out.append(DTensor.from_local(local.clone(), mesh, p, shape=v.shape))
        else:
            out.append(distribute_tensor(v, mesh, p, src_data_rank=None))
    return out


def test_gather_follows_index_without_comm():
    x = data("any", (7, 3), gen("gnc"))
    idx = _rand_index(3, (7, 2), gen("gnc2"))
    for pls, want in [(([S0], [S0]), (S0,)), (([R], [S1]), (S1,)), (([Partial("max")], [R]), (Partial("max"),))]:
        out, events = run_recorded((4,), lambda mesh: (lambda t, i: (torch.gather(t, 1, i).placements,
                                                             torch.gather(t, 1, i).full_tensor()))(
            *_placed(mesh, zip((x, idx), pls))))
        assert out[0][0] == want
        torch.testing.assert_close(out[0][1], torch.gather(x, 1, idx))


# -- scatter family ------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("xshape,ishape,sshape,dim", [((7, 3), (3, 3), (4, 3), 0), ((7, 3), (7, 2), (7, 2), 1),
                                                      ((3, 5), (3, 2), (3, 3), 1)])
def test_scatter_src(mesh, xshape, ishape, sshape, dim):
    g = gen(("scatter", xshape, ishape, dim))
    x, src = data("any", xshape, g), data("any", sshape, g)
    idx = _perm_index(xshape[dim], ishape, dim, g)
    check(lambda t, i, s: torch.scatter(t, dim, i, s), [x, idx, src], mesh,
          partial=[("sum", "max"), (), ("sum", "max")], limit=12, grad=ishape == sshape)


def test_scatter_keeps_shards_and_partials():
    x = data("any", (7, 3), gen("sk"))
    src = data("any", (7, 2), gen("sk2"))
    idx = _perm_index(3, (7, 2), 1, gen("sk3"))
    for pls, want in [(([S0], [S0], [S0]), (S0,)), (([Partial()], [R], [Partial()]), (Partial(),))]:
        out, events = run_recorded((4,), lambda mesh: torch.scatter(*_placed(mesh, [(x, pls[0])]), 1,
                                                            *_placed(mesh, [(idx, pls[1]), (src, pls[2])])).placements)
        assert out[0] == want and events == [], (pls, out[0], events)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("dim", [0, 1])
def test_scatter_value(mesh, dim):
    g = gen(("scatter_value", dim))
    x = data("any", (7, 3), g)
    ishape = (3, 3) if dim == 0 else (7, 2)
    idx = _rand_index(x.shape[dim], ishape, g)
    combos = [((Partial(k),) * len(mesh), (R,) * len(mesh)) for k in ("sum", "max", "product")]
    check(lambda t, i: torch.scatter(t, dim, i, 1.5), [x, idx], mesh, partial=[("sum", "max", "product"), ()], limit=8)
    seen = check(lambda t, i: torch.scatter(t, dim, i, 1.5), [x, idx], mesh, combos=combos)
    assert [out for _, out in seen] == [c[0] for c in combos]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("xshape,ishape,dim", [((7, 3), (5, 3), 0), ((7, 3), (7, 4), 1), ((3, 4), (3, 4), 0)])
def test_scatter_add(mesh, xshape, ishape, dim):
    g = gen(("scatter_add", xshape, ishape, dim))
    x, src = data("any", xshape, g), data("any", ishape, g)
    idx = _rand_index(xshape[dim], ishape, g)
    check(lambda t, i, s: torch.scatter_add(t, dim, i, s), [x, idx, src], mesh,
          partial=[("sum", "avg"), (), ("sum",)], limit=9)


def test_scatter_add_sharded_index_gives_partial_sum():
    x, src = data("any", (7, 3), gen("sa")), data("any", (8, 3), gen("sa2"))
    idx = _rand_index(7, (8, 3), gen("sa3"))
    seen = check(lambda t, i, s: torch.scatter_add(t, 0, i, s), [x, idx, src], (4,),
                 combos=[((R,), (S0,), (S0,))])
    assert seen[0][1] == (Partial("sum"),)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("reduce,include_self", [("sum", True), ("sum", False), ("prod", True), ("mean", False),
                                                  ("mean", True), ("amax", True), ("amin", False)])
def test_scatter_reduce(mesh, reduce, include_self):
    g = gen(("scatter_reduce", reduce, include_self))
    x, src = data("distinct", (7, 3), g) + 20, data("distinct", (5, 3), g) + 10
    idx = _rand_index(7, (5, 3), g)
    kinds = {"sum": ("sum", "avg"), "mean": ("sum",), "prod": ("product",), "amax": ("max",), "amin": ("min",)}[reduce]
    check(lambda t, i, s: torch.scatter_reduce(t, 0, i, s, reduce, include_self=include_self), [x, idx, src],
          mesh, partial=[kinds, (), kinds], limit=8, grad=reduce not in ("amax", "amin"),
          tol=dict(rtol=1e-4, atol=1e-3), grad_tol=dict(rtol=1e-4, atol=1e-3))


# -- index_add -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("xshape,n,dim", [((7, 3), 5, 0), ((7, 3), 4, 1), ((3, 7), 3, 0)])
def test_index_add(mesh, xshape, n, dim):
    g = gen(("index_add", xshape, n, dim))
    x = data("any", xshape, g)
    sshape = list(xshape)
    sshape[dim] = n
    src = data("any", tuple(sshape), g)
    idx = _rand_index(xshape[dim], (n,), g)
    check(lambda t, i, s: torch.index_add(t, dim, i, s, alpha=2.0), [x, idx, src], mesh,
          partial=[("sum", "avg"), (), ("sum",)], limit=9)


# -- advanced indexing ---------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("case", ["rows", "cols", "rows2d", "pair", "split3d", "mid3d"])
def test_index(mesh, case):
    g = gen(("index", case))
    if case in ("split3d", "mid3d"):
        x = data("any", (3, 7, 5), g)
    else:
        x = data("any", (7, 3), g)
    if case == "rows":
        vals, fn = [_rand_index(7, (5,), g)], lambda t, i: t[i]
    elif case == "cols":
        vals, fn = [_rand_index(3, (2,), g)], lambda t, i: t[:, i]
    elif case == "rows2d":
        vals, fn = [_rand_index(7, (2, 3), g)], lambda t, i: t[i]
    elif case == "pair":
        vals, fn = [_rand_index(7, (4,), g), _rand_index(3, (4,), g)], lambda t, i, j: t[i, j]
    elif case == "split3d":
        vals, fn = [_rand_index(3, (4,), g), _rand_index(5, (4,), g)], lambda t, i, j: t[i, :, j]
    else:
        vals, fn = [_rand_index(7, (4,), g)], lambda t, i: t[:, i]
    seen = check(fn, [x] + vals, mesh, partial=[("sum", "max")] + [()] * len(vals), limit=12)
    assert seen


def test_index_keeps_other_shards_without_comm():
    x = data("any", (7, 6), gen("ik"))
    idx = _rand_index(7, (4,), gen("ik2"))
    out, events = run_recorded((4,), lambda mesh: torch.ops.aten.index.Tensor(
        distribute_tensor(x, mesh, [S1], src_data_rank=None),
        [distribute_tensor(idx, mesh, [R], src_data_rank=None)]).placements)
    assert out[0] == (S1,) and events == []
    out, events = run_recorded((4,), lambda mesh: torch.ops.aten.index.Tensor(
        distribute_tensor(x, mesh, [R], src_data_rank=None),
        [distribute_tensor(idx, mesh, [S0], src_data_rank=None)]).placements)
    assert out[0] == (S0,) and events == []


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("case", ["rows", "cols", "accumulate", "acc_cols", "scalar"])
def test_index_put(mesh, case):
    g = gen(("index_put", case))
    x = data("any", (7, 3), g)
    if case == "rows":
        idx, v = _perm_index(7, (4,), 0, g), data("any", (4, 3), g)
        fn = lambda t, i, w: torch.index_put(t, (i,), w)
    elif case == "cols":
        idx, v = _perm_index(3, (2,), 0, g), data("any", (7, 2), g)
        fn = lambda t, i, w: torch.ops.aten.index_put.default(t, [None, i], w)
    elif case == "accumulate":
        idx, v = _rand_index(7, (5,), g), data("any", (5, 3), g)
        fn = lambda t, i, w: torch.index_put(t, (i,), w, accumulate=True)
    elif case == "acc_cols":
        idx, v = _rand_index(3, (4,), g), data("any", (4,), g)
        fn = lambda t, i, w: torch.ops.aten.index_put.default(t, [None, i], w, True)
    else:
        idx, v = _perm_index(7, (3,), 0, g), data("any", (1,), g)
        fn = lambda t, i, w: torch.index_put(t, (i,), w)
    check(fn, [x, idx, v], mesh, partial=[("sum", "max"), (), ("sum", "max")], limit=9)


@pytest.mark.parametrize("mesh", MESHES)
def test_index_put_mask_and_plain_scalar(mesh):
    g = gen("mask")
    x = data("any", (7, 3), g)
    m = data("bool", (7, 3), g)

    def fn(t, mask):
        return torch.index_put(t, (mask,), torch.tensor(0.5))

    seen = check(fn, [x, m], mesh, partial=[("sum", "max", "product"), ("max",)], limit=9)
    for (pl, ml), out in seen:
        if not any(isinstance(p, Partial) for p in ml) and pl == ml:
            assert out == pl


@pytest.mark.parametrize("mesh", MESHES)
def test_setitem_inplace(mesh):
    g = gen("setitem")
    x, v = data("any", (7, 3), g), data("any", (3, 3), g)
    idx = _perm_index(7, (3,), 0, g)

    def fn(t, i, w):
        y = t * 1.0
        y[i] = w
        return y

    check(fn, [x, idx, v], mesh, partial=[("sum",), (), ("sum",)], limit=10)


def test_data_dependent_ops_raise_when_strict():
    """Their rules cannot state the output's shape; without strict_sharding they run whole
    (tests/test_fallback.py)."""
    x = data("any", (7, 3), gen("dd"))

    def body(mesh):
        t = distribute_tensor(x, mesh, [S0], src_data_rank=None)
        msgs = []
        for f in (lambda: torch.nonzero(t), lambda: torch.masked_select(t, t > 0), lambda: t[t > 0]):
            try:
                with strict_sharding():
                    f()
            except NotImplementedError as e:
                msgs.append(str(e))
        return msgs

    out, _ = run_recorded((4,), body)
    assert len(out[0]) == 3
    for msg in out[0]:
        assert "full_tensor" in msg and "data-dependent" in msg, msg


# -- backward formulas of other families ------------------------------------------------------

_BACKWARD = {
    "max.dim": lambda t: t.max(dim=1).values,
    "min.dim": lambda t: t.min(dim=0, keepdim=True).values,
    "cummax": lambda t: torch.cummax(t, dim=1).values,
    "cummin": lambda t: torch.cummin(t, dim=0).values,
    "cumsum": lambda t: torch.cumsum(t, dim=1),
    "index_select": None,
    "topk": lambda t: torch.topk(t, 2, dim=1).values,
    "sort": lambda t: torch.sort(t, dim=0).values,
}


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", list(_BACKWARD))
def test_backward_of_other_families(mesh, name):
    g = gen(("bwd", name))
    x = data("distinct", (7, 3), g)
    if name == "index_select":
        idx = _rand_index(7, (5,), g)
        check(lambda t, i: torch.index_select(t, 0, i), [x, idx], mesh, partial=[("sum",), ()], limit=10)
        return
    check(_BACKWARD[name], [x], mesh, partial=("sum",), limit=10)


def test_max_dim_backward_direct():
    x = data("distinct", (7, 3), gen("maxdim"))
    want = x.clone().requires_grad_()
    want.max(dim=1).values.sum().backward()

    def body(mesh):
        t = distribute_tensor(x, mesh, [S0]).requires_grad_()
        t.max(dim=1).values.sum().backward()
        return t.grad.full_tensor()

    out, _ = run_recorded((4,), body)
    torch.testing.assert_close(out[0], want.grad)


# -- real processes ------------------------------------------------------------------------------

def gather_then_scatter_add(t, i, s):
    return torch.scatter_add(torch.gather(t, 0, i), 1, i.remainder(2), s)


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
def test_gloo_gather_scatter_add():
    from distributed import gloo_available

    if not gloo_available():
        pytest.skip("gloo not available")
    g = gen("gloo")
    x = data("any", (7, 3), g)
    idx = _rand_index(7, (5, 3), g)
    s = data("any", (5, 3), g)
    seen = check(gather_then_scatter_add, [x, idx, s], (4,), world="gloo",
                 combos=[((S1,), (S0,), (Partial(),))])
    assert seen[0][1] == (S0,)


@pytest.mark.parametrize("mesh", MESHES)
def test_index_put_and_index_copy_keep_the_values_layout(mesh):
    """A bool-mask index_put with a row of values, and index_copy, with self or values sharded
    off the indexed dim or Partial: the result keeps that layout (the replicated clone is sliced
    or split locally), forward and backward against one device."""
    x = data("any", (5, 6), gen("ipk"))
    mask = torch.tensor([True, False, True, True, False])
    row = data("any", (6,), gen("ipk-row"))
    check(lambda a, k, v: torch.index_put(a, (k,), v), [x, mask, row], mesh, limit=12, seed="ipk-mask")
    idx = torch.tensor([3, 0])
    src = data("any", (5, 2), gen("ipk-src"))
    check(lambda a, i, s: a.index_copy(1, i, s), [x, idx, src], mesh, limit=12, seed="ipk-copy")

    def body():
        m = init_device_mesh("cpu", mesh)
        a = distribute_tensor(x, m, [Replicate()] * len(mesh))
        v = distribute_tensor(row, m, [Shard(0)] + [Replicate()] * (len(mesh) - 1))
        with comm.recording() as log:
            out = torch.index_put(a, (distribute_tensor(mask, m, [Replicate()] * len(mesh)),), v)
        return out.placements[0], [e.kind for e in log.of_rank(m.get_rank()) if e.kind != "broadcast"]
    for first, kinds in run_spmd(body, math.prod(mesh)):
        assert first == Shard(1) and kinds == []
