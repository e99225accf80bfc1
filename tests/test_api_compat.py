"""torch DTensor API behaviours user code relies on (simulated world; gloo twins in test_gloo).

distribute_tensor with Partial placements (exact), ``Partial("prod")``, ``with mesh:`` as the
default mesh, from_local's global stride and run_check's per-field checks.
"""
from __future__ import annotations


import pytest
import torch

from opcheck import run_recorded  # noqa: E402

from shardtensor import (DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh,  # noqa: E402
                         run_spmd)
from shardtensor.mesh import current_mesh  # noqa: E402
from shardtensor.parallel import ColwiseParallel, parallelize_module  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.int64, torch.complex64, torch.float64]


def _value(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    v = torch.randn(5, 3, generator=g, dtype=torch.float64) * 7
    if dtype.is_complex:
        return torch.complex(v, -v).to(dtype)
    return v.to(dtype)


@pytest.mark.parametrize("op,dtype", [(op, d) for op in ("sum", "avg", "max", "min", "product") for d in DTYPES
                                      if not (d.is_complex and op in ("max", "min"))], ids=str)
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=str)
def test_distribute_tensor_partial_is_exact(mesh_shape, op, dtype):
    """full_tensor() gives the input bit for bit (torch's divides by n for sum, which rounds)."""
    full = _value(dtype)
    pls = [[Partial(op)] * len(mesh_shape)] + ([[Shard(0), Partial(op)], [Partial(op), Shard(1)]]
                                               if len(mesh_shape) == 2 else [])

    def body(mesh):
        out = []
        for pl in pls:
            x = distribute_tensor(full, mesh, pl)
            assert x.placements == tuple(pl) and x.dtype == dtype
            out.append(x.full_tensor())
        return out

    for rank_out in run_recorded(mesh_shape, body)[0]:
        for got in rank_out:
            assert got.dtype == dtype and torch.equal(got, full)


def test_distribute_tensor_partial_sum_terms_and_backward():
    """The terms: the value on coordinate 0, zeros elsewhere; gradients flow back as Replicate."""
    full = torch.arange(6.0).reshape(2, 3)

    def body(mesh):
        w = full.clone().requires_grad_()
        x = distribute_tensor(w, mesh, [Partial()])
        (x * 2).sum().backward()
        return x.to_local().detach(), w.grad

    for rank, (local, grad) in enumerate(run_recorded((4,), body)[0]):
        assert torch.equal(local, full if rank == 0 else torch.zeros(2, 3))


def test_partial_prod_is_product():
    assert Partial("prod") == Partial("product") and Partial("prod").reduce_op == "product"
    assert hash(Partial("prod")) == hash(Partial("product"))
    with pytest.raises(ValueError, match="reduce_op"):
        Partial("mul")


def test_mesh_context_manager_is_the_default_mesh():
    def body():
        outer = init_device_mesh("cpu", (4,))
        inner = init_device_mesh("cpu", (2, 2))
        assert current_mesh() is None
        with outer:
            a = distribute_tensor(torch.arange(8.0), placements=[Shard(0)])
            with inner as m:
                assert m is inner and current_mesh() is inner
                b = DTensor.from_local(torch.ones(2), placements=[Shard(0), Replicate()])
            assert current_mesh() is outer
            c = DTensor.from_local(torch.ones(2), placements=[Shard(0)])
            lin = parallelize_module(torch.nn.Linear(4, 8), parallelize_plan=ColwiseParallel())
        assert current_mesh() is None
        with pytest.raises(ValueError, match="device_mesh"):
            distribute_tensor(torch.ones(2), placements=[Replicate()])
        return (a.device_mesh == outer, b.device_mesh == inner, c.device_mesh == outer, tuple(b.shape),
                lin.weight.device_mesh == outer, a.full_tensor().sum().item())

    assert run_spmd(body, 4) == [(True, True, True, (4,), True, 28.0)] * 4


def test_mesh_context_is_per_rank_and_restored_on_error():
    def body():
        mesh = init_device_mesh("cpu", (4,))
        with pytest.raises(KeyError):
            with mesh:
                raise KeyError("x")
        return current_mesh()

    assert run_spmd(body, 4) == [None] * 4


@pytest.mark.parametrize("run_check", [None, False, True])
def test_from_local_stride_follows_the_local_layout(run_check):
    """A permuted piece of stride (8, 1, 32) under Shard(1) on 4 ranks: global stride (32, 1, 128)."""
    def body(mesh):
        local = torch.zeros(2, 4, 8).permute(1, 2, 0)
        x = DTensor.from_local(local, mesh, [Shard(1)], run_check=run_check)
        y = DTensor.from_local(torch.zeros(3, 5), mesh, [Shard(0)], run_check=run_check)
        return tuple(local.stride()), tuple(x.shape), x.stride(), y.stride(), x.permute(2, 0, 1).is_contiguous()

    assert run_recorded((4,), body)[0] == [((8, 1, 32), (4, 32, 2), (32, 1, 128), (5, 1), True)] * 4


def test_from_local_stride_with_uneven_pieces():
    """Pieces of 2, 2, 2 and 1 columns of a transposed layout agree on the order; size-1 dims order nothing."""
    def body(mesh):
        r = mesh.get_rank()
        cols = [2, 2, 2, 1][r]
        local = torch.zeros(cols, 3).t()  # shape (3, cols), column-major
        x = DTensor.from_local(local, mesh, [Shard(1)])
        return tuple(x.shape), x.stride()

    assert run_recorded((4,), body)[0] == [((3, 7), (1, 3))] * 4


def test_autograd_attributes_skip_torch_function_but_not_modes(monkeypatch):
    """``grad``, ``requires_grad``, ``is_leaf`` and ``is_sparse`` of a DTensor (read per parameter by
    optimizers, ``zero_grad`` and ``clip_grad_norm_``) behave as a plain tensor's: set, read and
    deleted through torch's own descriptors, without a call of ``DTensor.__torch_function__``, and
    seen by an active torch-function mode."""
    from torch.overrides import TorchFunctionMode

    def body(mesh):
        p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
        g = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
        calls = []
        orig = DTensor.__torch_function__.__func__
        monkeypatch.setattr(DTensor, "__torch_function__",
                            classmethod(lambda cls, f, t, a=(), k=None: calls.append(f) or orig(cls, f, t, a, k)))
        p.grad = g
        read = (p.grad is g, p.requires_grad, p.is_leaf, p.is_sparse)
        p.requires_grad = False
        off = p.requires_grad
        del p.grad
        gone = p.grad is None
        with pytest.raises(AttributeError):
            p.is_leaf = False
        monkeypatch.undo()
        seen = []

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                seen.append(getattr(func, "__self__", func).__name__)
                return func(*args, **(kwargs or {}))

        with Mode():
            p.requires_grad_(True).grad = g
        return read, off, gone, calls, seen

    out, _ = run_recorded((1,), body)
    read, off, gone, calls, seen = out[0]
    assert read == (True, True, True, False) and off is False and gone
    assert calls == []
    assert "grad" in seen


def test_to_own_device_returns_self_without_torch_function_but_not_under_modes(monkeypatch):
    """``x.to(x.device)`` (``clip_grad_norm_`` calls it per parameter) returns ``x`` itself, as for a
    plain tensor, without a call of ``DTensor.__torch_function__``; other moves and casts are
    torch's, and a torch-function mode still sees the call.  (One process, no simulated world:
    its ranks run under a torch-function mode of their own.)"""
    from torch.overrides import TorchFunctionMode

    mesh = init_device_mesh("cpu", (1,))
    x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    calls = []
    orig = DTensor.__torch_function__.__func__
    monkeypatch.setattr(DTensor, "__torch_function__",
                        classmethod(lambda cls, f, t, a=(), k=None: calls.append(f) or orig(cls, f, t, a, k)))
    assert x.to(torch.device("cpu")) is x
    assert calls == []
    y = x.to(torch.float64)
    assert x.to("cpu") is x
    assert len(calls) >= 2
    monkeypatch.undo()
    assert y.dtype == torch.float64 and y.placements == (Shard(0),)
    torch.testing.assert_close(y.full_tensor(), torch.arange(8.0, dtype=torch.float64).reshape(4, 2))
    seen = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Mode():
        assert x.to(torch.device("cpu")) is x
    assert "to" in seen


def test_repeated_from_local_reuses_its_spec_and_still_checks():
    """TP styles wrap every module input each step: a repeated ``from_local`` that needs no collective
    takes its spec from a cache (the same object), with the same values, strides and gradients; a
    piece the given global shape does not explain still raises on its rank after the good pieces were
    cached; a call that gathers the pieces' shapes gathers on every call."""
    def body(mesh):
        r = mesh.get_rank()
        specs, grads = [], []
        for step in range(3):
            a = torch.arange(10.0).reshape(2, 5).add(r).requires_grad_()
            x = DTensor.from_local(a, mesh, [Replicate()], run_check=False)
            y = DTensor.from_local(a.t(), mesh, [Shard(0)], shape=(20, 2))  # a column-major piece
            z = DTensor.from_local(a.t().contiguous(), mesh, [Shard(0)], shape=(20, 2))
            (x.to_local() * 2).sum().backward()
            specs.append((x._spec, y._spec, z._spec, y.stride(), z.stride()))
            grads.append(a.grad)
            DTensor.from_local(torch.ones(2, 5), mesh, [Shard(0)])  # no shape: the shapes are gathered
        rows = [2, 2, 2, 1][r] + (1 if r == 3 else 0)  # rank 3's piece is one row too long
        bad = None
        try:
            DTensor.from_local(torch.ones(rows, 5), mesh, [Shard(0)], shape=(7, 5))
        except ValueError as e:
            bad = str(e)
        return specs, grads, bad

    out, events = run_recorded((4,), body)
    for specs, grads, bad in out:
        assert all(s[0] is specs[0][0] and s[1] is specs[0][1] and s[2] is specs[0][2] for s in specs)
        assert specs[0][3] == (1, 20) and specs[0][4] == (2, 1)
        assert all(torch.equal(g, torch.full((2, 5), 2.0)) for g in grads)
    assert [bad is None for _, _, bad in out] == [True, True, True, False]
    assert "rank 3" in out[3][2] and "(2, 5)" in out[3][2]
    assert sum(e.kind == "all_gather" for e in events) == 3 * 4  # one gather per call and rank


def test_from_local_on_a_new_mesh_never_takes_an_old_meshs_spec():
    """The repeated-call cache keys a mesh by identity: a mesh freed and another one built at the
    same address (CPython reuses it at once) must not get the freed mesh's spec.  Meshes of other
    ranks alternate with equal ones built afresh, whose specs hold the first mesh of their value."""
    from shardtensor import DeviceMesh

    def body(mesh):
        wrong = []
        for i in range(200):
            ranks = [[0, 1, 2, 3], [0, 1], [0, 2], [0, 3]][i % 4]
            if mesh.get_rank() not in ranks:
                continue
            m = DeviceMesh("cpu", ranks)
            x = DTensor.from_local(torch.ones(2, 3), m, [Replicate()], run_check=False)
            if x.device_mesh != m:
                wrong.append((i, ranks, x.device_mesh.mesh.tolist()))
            del m, x
        return wrong

    assert run_recorded((4,), body)[0] == [[]] * 4


@pytest.mark.parametrize("field", ["dtype", "requires_grad", "memory layout"])
def test_run_check_names_the_field_and_the_ranks(field):
    def body(mesh):
        odd = mesh.get_rank() in (1, 3)
        local = {"dtype": lambda: torch.zeros(2, 3, dtype=torch.float64 if odd else torch.float32),
                 "requires_grad": lambda: torch.zeros(2, 3, requires_grad=odd),
                 "memory layout": lambda: torch.zeros(3, 2).t() if odd else torch.zeros(2, 3)}[field]()
        try:
            DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
        except ValueError as e:
            return str(e)
        return None

    for msg in run_recorded((4,), body)[0]:
        assert msg is not None and field in msg and "rank 1" in msg and "rank 3" in msg


# -- placements show a nested shard order ---------------------------------------------------

def test_placements_repr_shows_a_nested_shard_order_and_passes_it_back():
    import copy
    import pickle

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(torch.arange(16.).reshape(8, 2), mesh, [Shard(0), Shard(0)])
        y = x.redistribute(mesh, [Shard(0), Shard(0)], shard_order={0: [1, 0]})
        z = x.redistribute(mesh, y.placements)  # the order travels with the placements
        pl = y.placements
        return (repr(x.placements), repr(pl), pl == (Shard(0), Shard(0)), hash(pl) == hash((Shard(0), Shard(0))),
                z.shard_order == y.shard_order, torch.equal(z.to_local(), y.to_local()),
                repr(pickle.loads(pickle.dumps(pl))), repr(copy.deepcopy(pl)), "[1]" in repr(y))

    for r in run_spmd(body, 4):
        assert r[0] == "(Shard(dim=0), Shard(dim=0))"  # the default order shows nothing extra
        assert r[1] == r[6] == r[7] == "(Shard(dim=0)[1], Shard(dim=0)[0])"
        assert all(r[2:6]) and r[8]


# -- local_map ------------------------------------------------------------------------------

def test_local_map_runs_on_local_tensors_forward_and_backward():
    from shardtensor.experimental import local_map

    w_full = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    x_full = torch.randn(5, 6, generator=torch.Generator().manual_seed(4))

    @local_map(out_placements=[Shard(1)], in_placements=([Replicate()], [Shard(0)]),
               in_grad_placements=([Partial()], None), redistribute_inputs=True)
    def local_linear(x, w):
        assert not isinstance(x, DTensor) and not isinstance(w, DTensor)
        return x @ w.t()

    def body():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(x_full, mesh, [Shard(0)]).requires_grad_()  # redistributed to Replicate
        w = distribute_tensor(w_full, mesh, [Shard(0)]).requires_grad_()
        y = local_linear(x, w)
        y.full_tensor().pow(2).sum().backward()
        strict = local_map(lambda a: a * 2, out_placements=[Shard(0)], in_placements=([Replicate()],))
        with pytest.raises(ValueError, match="redistribute_inputs=True"):
            strict(distribute_tensor(x_full, mesh, [Shard(0)]))
        two = local_map(lambda a: (a + 1, a.sum(), "tag"), out_placements=([Shard(0)], [Partial()], None))
        a, s, tag = two(distribute_tensor(torch.ones(7, 2), mesh, [Shard(0)]))
        plain = local_map(lambda a: a + 1, out_placements=[Shard(0)])(torch.ones(2))
        return (y.placements, y.full_tensor(), x.grad.full_tensor(), w.grad.full_tensor(), tuple(a.shape),
                s.full_tensor(), tag, type(plain))

    xr, wr = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    yr = xr @ wr.t()
    yr.pow(2).sum().backward()
    for pl, y, gx, gw, a_shape, s, tag, plain in run_spmd(body, 4):
        assert pl == (Shard(1),)
        torch.testing.assert_close(y, yr.detach())
        torch.testing.assert_close(gx, xr.grad)
        torch.testing.assert_close(gw, wr.grad)
        assert a_shape == (7, 2) and s.item() == 14.0 and tag == "tag"  # uneven output: real global shape
        assert plain is torch.Tensor  # no DTensor argument: func runs as is


def test_shard_local_shard_size_and_offset_is_torchs():
    from torch.distributed.tensor import Shard as TorchShard

    for n in range(0, 13):
        for k in range(1, 6):
            for r in range(k):
                want = tuple(int(v) for v in TorchShard.local_shard_size_and_offset(n, k, r))
                assert Shard.local_shard_size_and_offset(n, k, r) == want, (n, k, r)


def test_compute_local_shape_and_global_offset_is_torchs_on_every_coordinate():
    """torch's helper reads only its own placement classes; ours gives its answers for ours."""
    import itertools

    from torch.distributed.tensor import Replicate as TR, Shard as TS
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as torch_helper

    from shardtensor import compute_local_shape_and_global_offset

    def body(mesh):
        out = []
        for shape in ((7, 5), (3, 0), (2, 9, 4)):
            dims = [Replicate()] + [Shard(d) for d in range(len(shape))]
            for pl in itertools.product(dims, repeat=mesh.ndim):
                theirs = [TR() if p.is_replicate() else TS(p.dim) for p in pl]
                want = torch_helper(shape, mesh.shape, mesh.get_coordinate(), theirs)
                got = compute_local_shape_and_global_offset(shape, mesh, list(pl))
                out.append((shape, pl, got, tuple(map(tuple, want))))
        return out

    for mesh_shape in ((4,), (2, 2), (3, 2)):
        for per_rank in run_recorded(mesh_shape, body)[0]:
            bad = [(s, p, g, w) for s, p, g, w in per_rank if g != w]
            assert not bad, bad[:3]


def test_get_group_in_the_simulated_world_says_what_to_use():
    def body(mesh):
        with pytest.raises(RuntimeError, match="torchrun"):
            mesh.get_group(0)
        with pytest.raises(ValueError, match="mesh_dim"):
            mesh.get_group()
        return True

    assert run_recorded((2, 2), body)[0] == [True] * 4


def test_local_map_reads_a_tuple_of_placement_sequences_as_one_per_flattened_output():
    """torch's reading: ``out_placements=((Partial(),),)`` is one output's placements; outputs
    are flattened as pytrees (a dict of tensors takes one entry per leaf)."""
    from shardtensor.experimental import local_map

    def body():
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(torch.arange(6.), mesh, [Shard(0)])
        total = local_map(lambda a: a.sum(), out_placements=((Partial(),),))(x)
        parts = local_map(lambda a: {"sum": a.sum(), "double": a * 2},
                          out_placements=((Partial(),), (Shard(0),)))(x)
        with pytest.raises(ValueError, match="2 outputs .flattened. for 1 out_placements"):
            local_map(lambda a: (a, a), out_placements=((Shard(0),),))(x)
        return total.full_tensor().item(), parts["sum"].full_tensor().item(), parts["double"].full_tensor()

    for total, s, double in run_spmd(body, 2):
        assert total == s == 15.0 and torch.equal(double, torch.arange(6.) * 2)


def test_unflatten_and_flatten_build_meshes_as_torchtitan_does():
    """torchtitan builds every mesh from one world mesh: ``_unflatten(0, sizes, names)``, then
    ``mesh["a", "b"]._flatten("name")``, which the mesh also gives as ``mesh["name"]``; the rank
    grids are torch's (row-major)."""
    def body():
        world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
        mesh = world._unflatten(0, (2, 2, 2), ("dp", "cp", "tp"), backend_override={"cp": "fake"})
        loss = mesh["dp", "cp"]._flatten("loss")
        sub = mesh["dp", "tp"]._unflatten("tp", (2, 1), ("a", "b"))
        x = distribute_tensor(torch.arange(8.), loss, [Shard(0)])
        errors = []
        for call in (lambda: world._unflatten(0, (3, 3), ("a", "b")), lambda: world._unflatten(0, (2, 4), ("a",)),
                     lambda: mesh["dp", "tp"]._flatten("cp"), lambda: mesh["dp", "loss"],
                     lambda: world._unflatten(0, (2, 4), ("a", "b"), backend_override={"c": "fake"})):
            with pytest.raises((ValueError, NotImplementedError)) as info:
                call()
            errors.append(str(info.value))
        return (mesh.mesh.tolist(), mesh.mesh_dim_names, loss.mesh.tolist(), mesh["loss"] == loss,
                sub.mesh.tolist(), sub.mesh_dim_names, x.to_local().tolist(), x.full_tensor().tolist(), errors)

    out = run_spmd(body, 8)
    grid, names, loss, same, sub, sub_names, local, full, errors = out[0]
    assert grid == torch.arange(8).reshape(2, 2, 2).tolist() and names == ("dp", "cp", "tp")
    assert loss == [0, 2, 4, 6] and same and sub == [[[0], [1]], [[4], [5]]] and sub_names == ("dp", "a", "b")
    assert local == [0.0, 1.0] and full == list(map(float, range(8)))
    assert out[3][2] == [1, 3, 5, 7] and out[3][6] == [2.0, 3.0]  # rank 3 is (0, 1, 1): the tp=1 loss group
    assert "multiply to 9" in errors[0] and "as many positive sizes as names" in errors[1]
    assert "already names a dim" in errors[2] and "sliced alone" in errors[3] and "backend_override" in errors[4]
