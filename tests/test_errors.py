"""Bad input gives a clear ValueError/TypeError naming the offending value; nothing hangs.

Also: ``run_spmd`` semantics (errors re-raised with their type and rank, other ranks end
instead of hanging, results in rank order, no nesting) and the DeviceMesh API.
"""
from __future__ import annotations

import re
import threading
import time

import pytest
import torch

import shardtensor
from shardtensor import (DeviceMesh, DTensor, MixedTensorError, Partial, Replicate, Shard, distribute_tensor,
                         errors, init_device_mesh, run_spmd)

P, R, S0, S1 = Partial("sum"), Replicate(), Shard(0), Shard(1)
X = torch.arange(35, dtype=torch.float32).reshape(7, 5)
FAST = 10.0  # seconds: every error case must end well within this (the default comm timeout is 120 s)


def body_of(e: BaseException) -> str:
    """The message without run_spmd's "[rank r of n] " prefix (so digits there cannot satisfy a check)."""
    return re.sub(r"^\[rank \d+ of \d+\] ", "", str(e))


def spmd_raises(exc, fn, world_size=4, *args, match: str | None = None, **kwargs):
    """Run ``fn`` in a simulated world; it must raise ``exc`` quickly. Returns the exception."""
    t0 = time.monotonic()
    with pytest.raises(exc) as ei:
        run_spmd(fn, world_size, *args, timeout=30.0, **kwargs)
    took = time.monotonic() - t0
    assert took < FAST, f"took {took:.1f}s: some rank waited for a timeout instead of failing fast"
    assert re.search(r"\[rank \d+ of %d\]" % world_size, str(ei.value)), f"no rank prefix: {ei.value}"
    if match is not None:
        assert re.search(match, body_of(ei.value)), f"{match!r} not in: {ei.value}"
    return ei.value


def mesh1d():
    return init_device_mesh("cpu", (4,))


def mesh2d():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


# ---------------------------------------------------------------------------------------
# placements
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [2, 7, -3])
def test_shard_dim_out_of_range_distribute(dim):
    def body():
        distribute_tensor(X, mesh1d(), [Shard(dim)])

    e = spmd_raises(ValueError, body)
    assert f"Shard(dim={dim})" in str(e) or f"S({dim})" in str(e), str(e)
    assert "2" in body_of(e).replace(f"dim={dim}", ""), f"message should say the tensor has 2 dims: {e}"


def test_shard_dim_out_of_range_from_local():
    def body():
        DTensor.from_local(torch.ones(2, 5), mesh2d(), [R, Shard(3)])

    e = spmd_raises(ValueError, body)
    assert "Shard(dim=3)" in str(e) or "S(3)" in str(e), str(e)


def test_shard_dim_out_of_range_redistribute():
    def body():
        distribute_tensor(X, mesh1d(), [S0]).redistribute(placements=[Shard(4)])

    e = spmd_raises(ValueError, body)
    assert "Shard(dim=4)" in str(e) or "S(4)" in str(e), str(e)


def test_negative_shard_dim_in_range_is_normalized():
    def body():
        d = distribute_tensor(X, mesh1d(), [Shard(-1)])
        return d.placements, d.full_tensor()

    for pl, full in run_spmd(body, 4, timeout=30.0):
        assert pl == (S1,)
        assert torch.equal(full, X)


@pytest.mark.parametrize("placements,n", [([S0], 1), ([S0, R, R], 3), ([], 0)], ids=["1", "3", "0"])
def test_placements_count_must_match_mesh_ndim(placements, n):
    def body():
        distribute_tensor(X, mesh2d(), placements)

    e = spmd_raises(ValueError, body)
    msg = body_of(e)
    assert str(n) in msg and "2" in msg, f"message should give both counts ({n} and 2): {msg}"


def test_placements_count_from_local():
    def body():
        DTensor.from_local(torch.ones(2, 5), mesh1d(), [S0, R])

    e = spmd_raises(ValueError, body)
    assert "2" in body_of(e) and "1" in body_of(e), str(e)


def test_placements_count_redistribute():
    def body():
        distribute_tensor(X, mesh2d(), [S0, R]).redistribute(placements=[R])

    e = spmd_raises(ValueError, body)
    assert "Replicate()" in str(e) and "2" in body_of(e), str(e)


@pytest.mark.parametrize("bad,expect", [
    (Shard(0), TypeError),  # a single Placement, not a sequence
    ([0], TypeError),
    (["Shard(0)"], TypeError),
    ([None], TypeError),
], ids=["bare", "int", "str", "none"])
def test_placements_of_wrong_type(bad, expect):
    def body():
        distribute_tensor(X, mesh1d(), bad)

    e = spmd_raises(expect, body)
    shown = repr(bad[0]) if isinstance(bad, list) else repr(bad)
    assert shown in str(e) or str(bad) in str(e), f"message should show {shown}: {e}"


def test_placement_constructors_validate():
    with pytest.raises(TypeError, match="'0'"):
        Shard("0")
    with pytest.raises(TypeError, match="1.0"):
        Shard(1.0)
    with pytest.raises(TypeError):
        Shard(True)
    with pytest.raises(ValueError, match="'mean'"):
        Partial("mean")


def test_distribute_tensor_without_a_mesh_says_how_to_give_one():
    e = spmd_raises(ValueError, lambda: distribute_tensor(X, placements=[Replicate()]))
    assert "device_mesh" in str(e) and "with mesh:" in str(e)


# ---------------------------------------------------------------------------------------
# non-tensors where a tensor is needed
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,name", [([1.0, 2.0], "list"), (3.0, "float"), ("abc", "str"), (None, "NoneType")],
                         ids=["list", "float", "str", "none"])
def test_distribute_tensor_non_tensor(value, name):
    def body():
        distribute_tensor(value, mesh1d(), [R])

    e = spmd_raises(TypeError, body)
    assert name in str(e), f"message should name the type {name}: {e}"


@pytest.mark.parametrize("value,name", [([1.0, 2.0], "list"), (2, "int")], ids=["list", "int"])
def test_from_local_non_tensor(value, name):
    def body():
        DTensor.from_local(value, mesh1d(), [R])

    e = spmd_raises(TypeError, body)
    assert name in str(e), str(e)


def test_from_local_refuses_a_dtensor():
    def body():
        m = mesh1d()
        d = distribute_tensor(X, m, [S0])
        DTensor.from_local(d, m, [S0])

    e = spmd_raises(TypeError, body)
    assert "DTensor" in str(e), str(e)


def test_distribute_tensor_refuses_a_dtensor():
    def body():
        m = mesh1d()
        distribute_tensor(distribute_tensor(X, m, [S0]), m, [R])

    spmd_raises(TypeError, body, match="DTensor")


def test_non_mesh_where_a_mesh_is_needed_distribute():
    def body():
        distribute_tensor(X, "not-a-mesh", [R])

    spmd_raises(TypeError, body, match="not-a-mesh")


def test_non_mesh_where_a_mesh_is_needed_from_local():
    def body():
        DTensor.from_local(X, [0, 1, 2, 3], [R])

    spmd_raises(TypeError, body, match=r"\[0, 1, 2, 3\]")


@pytest.mark.parametrize("src", [7, -1])
def test_distribute_tensor_bad_src_data_rank(src):
    def body():
        distribute_tensor(X, mesh1d(), [S0], src_data_rank=src)

    spmd_raises(ValueError, body, match=str(src))


def test_from_local_needs_a_mesh():
    def body():
        DTensor.from_local(X, None, [R])

    spmd_raises(ValueError, body, match="device_mesh")


def test_mixing_plain_tensor_with_dtensor():
    plain = torch.ones(7, 5)

    def body():
        d = distribute_tensor(X, mesh1d(), [S0])
        return torch.add(d, plain)

    e = spmd_raises(MixedTensorError, body)
    assert "(7, 5)" in str(e), f"message should show the plain tensor's shape: {e}"
    assert "add" in str(e), f"message should name the op: {e}"
    assert "implicit_replication" in str(e) and "distribute_tensor" in str(e), f"message should say what to do: {e}"


def test_mixing_plain_tensor_via_python_operators():
    """``d + plain`` and ``plain * d`` give the same explanation as ``torch.add`` (not Python's bare
    "unsupported operand type(s)", which a TypeError under ``Tensor.__add__`` would become)."""
    plain = torch.ones(5)

    def body():
        d = distribute_tensor(X, mesh1d(), [S0])
        d + plain

    spmd_raises(MixedTensorError, body, match=r"plain torch.Tensor of shape \(5,\)")

    def body2():
        d = distribute_tensor(X, mesh1d(), [S0])
        plain * d

    spmd_raises(MixedTensorError, body2, match="implicit_replication")


def test_mixing_plain_tensor_in_where():
    cond = torch.ones(7, 5, dtype=torch.bool)

    def body():
        d = distribute_tensor(X, mesh1d(), [S0])
        torch.where(cond, d, d)

    spmd_raises(MixedTensorError, body, match=r"\(7, 5\)")


def test_zero_dim_plain_tensor_is_a_scalar():
    def body():
        d = distribute_tensor(X, mesh1d(), [S0])
        return (d * torch.tensor(2.0)).full_tensor()

    for full in run_spmd(body, 4, timeout=30.0):
        assert torch.equal(full, X * 2)


# ---------------------------------------------------------------------------------------
# meshes
# ---------------------------------------------------------------------------------------
def test_mismatched_meshes_1d_vs_2d():
    def body():
        a = distribute_tensor(X, mesh1d(), [S0])
        b = distribute_tensor(X, mesh2d(), [S0, R])
        return a + b

    e = spmd_raises(ValueError, body)
    assert "[0, 1, 2, 3]" in str(e) and "[[0, 1], [2, 3]]" in str(e), f"message should show both meshes: {e}"


def test_mismatched_meshes_same_shape_different_rank_order():
    def body():
        a = distribute_tensor(X, DeviceMesh("cpu", [0, 1, 2, 3]), [S0])
        b = distribute_tensor(X, DeviceMesh("cpu", [3, 2, 1, 0]), [S0])
        return a * b

    e = spmd_raises(ValueError, body)
    assert "[3, 2, 1, 0]" in str(e), str(e)


def test_mismatched_meshes_2d_flattened_differently():
    def body():
        a = distribute_tensor(X, DeviceMesh("cpu", [[0, 1], [2, 3]]), [S0, R])
        b = distribute_tensor(X, DeviceMesh("cpu", [[0, 2], [1, 3]]), [S0, R])
        return a - b

    spmd_raises(ValueError, body, match=r"\[\[0, 2\], \[1, 3\]\]")


def test_mismatched_meshes_submesh_vs_parent():
    def body():
        m = mesh2d()
        a = distribute_tensor(X, m, [R, S0])
        b = distribute_tensor(X, m["tp"], [S0])
        return a + b

    spmd_raises(ValueError, body)


def test_mismatched_meshes_two_submeshes():
    def body():
        m = mesh2d()
        a = distribute_tensor(X, m["tp"], [S0])
        b = distribute_tensor(X, m["dp"], [S0])
        return torch.maximum(a, b)

    spmd_raises(ValueError, body)


def test_same_mesh_built_twice_is_compatible():
    def body():
        a = distribute_tensor(X, mesh1d(), [S0])
        b = distribute_tensor(X, mesh1d(), [R])
        return (a + b).full_tensor()

    for full in run_spmd(body, 4, timeout=30.0):
        assert torch.equal(full, 2 * X)


def test_cross_mesh_redistribute_with_bad_placements_names_them():
    def body():
        a = distribute_tensor(X, mesh1d(), [S0])
        a.redistribute(DeviceMesh("cpu", [3, 2, 1, 0]), [Shard(5)])

    e = spmd_raises(ValueError, body)
    assert "Shard(dim=5)" in str(e)


@pytest.mark.parametrize("shape,world", [((2, 2), 3), ((4,), 2), ((2, 3), 4), ((8,), 4)])
def test_world_size_mismatch(shape, world):
    n = 1
    for s in shape:
        n *= s

    def body():
        init_device_mesh("cpu", shape)

    e = spmd_raises(ValueError, body, world)
    msg = body_of(e)
    assert str(n) in msg and str(world) in msg, f"message should give {n} and {world}: {e}"


def test_world_size_mismatch_outside_run_spmd():
    """Outside run_spmd (and without torch.distributed) the world has one rank."""
    with pytest.raises(ValueError) as ei:
        init_device_mesh("cpu", (2, 2))
    assert "4" in str(ei.value) and "1" in str(ei.value)


@pytest.mark.parametrize("shape", [(), (0,), (2, -1), (2.0, 2), (True,)], ids=str)
def test_bad_mesh_shape(shape):
    def body():
        init_device_mesh("cpu", shape)

    e = spmd_raises(ValueError, body)
    assert repr(shape) in str(e) or str(shape) in str(e), str(e)


def test_device_mesh_bad_ranks():
    def rank_outside():
        DeviceMesh("cpu", [0, 1, 5])

    spmd_raises(ValueError, rank_outside, match="5")

    def duplicate():
        DeviceMesh("cpu", [0, 1, 1, 2])

    spmd_raises(ValueError, duplicate, match=r"\[0, 1, 1, 2\]")

    def bad_names():
        DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp",))

    spmd_raises(ValueError, bad_names, match="dp")

    def dup_names():
        DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("x", "x"))

    spmd_raises(ValueError, dup_names, match="x")

    def device_type():
        DeviceMesh(0, [0, 1, 2, 3])

    spmd_raises(TypeError, device_type, match="0")


# ---------------------------------------------------------------------------------------
# from_local shape checks
# ---------------------------------------------------------------------------------------
def test_from_local_run_check_disagreeing_shard_shapes():
    """Rows per rank (2, 2, 2, 3) cannot be a chunk split of 9 rows ((3, 3, 3, 0))."""
    def body():
        m = mesh1d()
        rows = 3 if m.get_rank() == 3 else 2
        DTensor.from_local(torch.ones(rows, 5), m, [S0], run_check=True)

    e = spmd_raises(ValueError, body)
    msg = str(e)
    assert "(3, 5)" in msg and "rank 3" in msg, f"message should name rank 3 and its shape: {msg}"


def test_from_local_run_check_disagreeing_replicate_shapes():
    def body():
        m = mesh1d()
        cols = 4 if m.get_rank() == 1 else 5
        DTensor.from_local(torch.ones(7, cols), m, [R], run_check=True)

    e = spmd_raises(ValueError, body)
    assert "(7, 4)" in str(e), str(e)


def test_from_local_run_check_disagreeing_ndim():
    def body():
        m = mesh1d()
        t = torch.ones(2, 5, 1) if m.get_rank() == 2 else torch.ones(2, 5)
        DTensor.from_local(t, m, [S0], run_check=True)

    spmd_raises(ValueError, body, match="ndim|dims")


def test_from_local_run_check_2d_mesh():
    def body():
        m = mesh2d()
        c = m.get_coordinate()
        rows = 3 if tuple(c) == (1, 1) else 2
        DTensor.from_local(torch.ones(rows, 5), m, [R, S0], run_check=True)

    spmd_raises(ValueError, body, match=r"\(3, 5\)")


def test_from_local_run_check_disagreeing_dtypes():
    """run_check=True: one rank's float64 piece among float32 pieces is an error, not a DTensor whose
    dtype depends on the rank."""
    def body():
        m = mesh1d()
        dt = torch.float64 if m.get_rank() == 1 else torch.float32
        DTensor.from_local(torch.ones(2, 5, dtype=dt), m, [S0], run_check=True)

    spmd_raises(ValueError, body, match="float64")


def test_from_local_run_check_accepts_uneven_chunks():
    """(2, 2, 2, 1) rows is the chunk split of 7: no error, global shape (7, 5)."""
    def body():
        m = mesh1d()
        rows = [2, 2, 2, 1][m.get_rank()]
        d = DTensor.from_local(X[2 * m.get_rank():2 * m.get_rank() + rows].clone(), m, [S0], run_check=True)
        return tuple(d.shape), d.full_tensor()

    for shape, full in run_spmd(body, 4, timeout=30.0):
        assert shape == (7, 5)
        assert torch.equal(full, X)


def test_from_local_explicit_shape_disagrees_on_one_rank():
    """Only rank 3 holds a wrong piece: it raises, the others must not hang in their next collective."""
    def body():
        m = mesh1d()
        rows = [2, 2, 2, 1][m.get_rank()] + (1 if m.get_rank() == 3 else 0)
        d = DTensor.from_local(torch.ones(rows, 5), m, [S0], shape=(7, 5))
        d.full_tensor()

    e = spmd_raises(ValueError, body)
    msg = str(e)
    assert "rank 3" in msg and "(2, 5)" in msg and "(1, 5)" in msg, msg


def test_from_local_shape_with_wrong_ndim():
    def body():
        DTensor.from_local(torch.ones(2, 5), mesh1d(), [S0], shape=(8, 5, 1))

    spmd_raises(ValueError, body, match=r"\(8, 5, 1\)")


# ---------------------------------------------------------------------------------------
# redistribute to Partial
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("src", [R, S0, Partial("avg")], ids=str)
def test_public_redistribute_to_partial_refused(src):
    def body():
        m = mesh1d()
        if isinstance(src, Partial):
            d = DTensor.from_local(X / 4, m, [src])
        else:
            d = distribute_tensor(X, m, [src])
        d.redistribute(m, [P])

    e = spmd_raises(RuntimeError, body)
    assert "Partial(sum)" in str(e) or "P(sum)" in str(e), str(e)


def test_redistribute_partial_to_same_partial_allowed():
    def body():
        m = mesh1d()
        d = DTensor.from_local(X / 4, m, [P])
        e = d.redistribute(m, [P])
        return e.placements, e.full_tensor()

    for pl, full in run_spmd(body, 4, timeout=30.0):
        assert pl == (P,)
        assert torch.equal(full, X)


def test_redistribute_without_placements():
    def body():
        distribute_tensor(X, mesh1d(), [S0]).redistribute(mesh1d())

    spmd_raises(RuntimeError, body)


# ---------------------------------------------------------------------------------------
# run_spmd
# ---------------------------------------------------------------------------------------
class Boom(Exception):
    pass


def test_run_spmd_results_in_rank_order():
    def body(base, scale=1):
        m = mesh1d()
        r = m.get_rank()
        time.sleep(0.02 * (3 - r))  # later ranks finish first
        return base + scale * r

    assert run_spmd(body, 4, 100, scale=10) == [100, 110, 120, 130]
    assert run_spmd(lambda: "only", 1) == ["only"]


def test_run_spmd_error_type_and_rank():
    def body():
        m = mesh1d()
        if m.get_rank() == 2:
            raise Boom("bad thing on two")
        return m.get_rank()

    e = spmd_raises(Boom, body)
    assert type(e) is Boom
    assert str(e).startswith("[rank 2 of 4] "), str(e)
    assert "bad thing on two" in str(e)
    assert getattr(e, "rank", None) == 2


def test_run_spmd_error_without_args():
    def body():
        if init_device_mesh("cpu", (2,)).get_rank() == 1:
            raise KeyError()

    e = spmd_raises(KeyError, body, 2)
    assert "rank 1 of 2" in str(e)


def test_run_spmd_others_blocked_in_collective_do_not_hang():
    """Rank 1 fails; ranks 0, 2, 3 wait in a gather for it. The call ends at once with rank 1's error."""
    def body():
        m = mesh1d()
        d = distribute_tensor(X, m, [S0])
        if m.get_rank() == 1:
            time.sleep(0.2)  # let the others get into the collective first
            raise ValueError("rank one gives up")
        return d.full_tensor()

    e = spmd_raises(ValueError, body)
    assert str(e).startswith("[rank 1 of 4]") and "rank one gives up" in str(e), str(e)


def test_run_spmd_others_blocked_in_later_collectives_do_not_hang():
    """2-D mesh: rank 0 fails; rank 1 waits for it in the tp group; ranks 2, 3 finish a tp
    collective, then wait in the dp group. Everybody ends, with rank 0's error."""
    def body():
        m = mesh2d()
        d = distribute_tensor(X, m, [S0, S1])
        if m.get_rank() == 0:
            time.sleep(0.2)
            raise Boom("zero")
        d = d.redistribute(m, [S0, R])  # tp-group gather
        return d.full_tensor()  # dp-group gather

    e = spmd_raises(Boom, body)
    assert str(e).startswith("[rank 0 of 4]")


def test_run_spmd_error_after_others_returned():
    def body():
        m = mesh1d()
        if m.get_rank() == 3:
            time.sleep(0.1)
            raise Boom("late")
        return 1

    e = spmd_raises(Boom, body)
    assert "[rank 3 of 4]" in str(e)


def test_run_spmd_first_real_error_wins():
    """Two ranks fail for real; the error reported is a real one (not an abort of a waiting rank)."""
    def body():
        m = mesh1d()
        r = m.get_rank()
        if r == 2:
            raise Boom("two")
        if r == 3:
            time.sleep(0.2)
            raise ValueError("three")
        distribute_tensor(X, m, [S0]).full_tensor()

    e = spmd_raises((Boom, ValueError), body)
    assert "[rank 2 of 4]" in str(e) or "[rank 3 of 4]" in str(e)
    assert "abort" not in str(e).lower()


def test_run_spmd_collective_timeout():
    """A rank that never arrives (and never fails) ends the others by the timeout, with an error."""
    def body():
        m = mesh1d()
        if m.get_rank() == 0:
            time.sleep(1.5)
            return "slow"
        distribute_tensor(X, m, [S0]).full_tensor()
        return "waited"

    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as ei:
        run_spmd(body, 4, timeout=0.3)
    assert time.monotonic() - t0 < FAST
    assert "timed out" in str(ei.value) and "[rank " in str(ei.value)


def test_run_spmd_nested_refused():
    def body():
        return run_spmd(lambda: 1, 2)

    e = spmd_raises(RuntimeError, body, 2)
    assert "nest" in str(e).lower(), str(e)


def test_run_spmd_usable_after_failure():
    def bad():
        m = mesh1d()
        if m.get_rank() == 0:
            raise Boom("x")
        m2 = mesh1d()
        distribute_tensor(X, m2, [S0]).full_tensor()

    spmd_raises(Boom, bad)

    def good():
        return distribute_tensor(X, mesh1d(), [S0]).full_tensor()

    for full in run_spmd(good, 4, timeout=30.0):
        assert torch.equal(full, X)
    # and outside any world the calling thread is a world of one again
    assert init_device_mesh("cpu", (1,)).get_coordinate() == [0]


def test_run_spmd_bad_arguments():
    with pytest.raises(TypeError, match="42"):
        run_spmd(42, 2)
    with pytest.raises(ValueError, match="0"):
        run_spmd(lambda: None, 0)
    with pytest.raises(ValueError, match="'4'"):
        run_spmd(lambda: None, "4")


def test_run_spmd_threads_do_not_leak():
    before = threading.active_count()

    def body():
        if mesh1d().get_rank() == 1:
            raise Boom("x")
        distribute_tensor(X, mesh1d(), [S0]).full_tensor()

    for _ in range(3):
        spmd_raises(Boom, body)
    run_spmd(lambda: None, 4)
    assert threading.active_count() <= before


# ---------------------------------------------------------------------------------------
# DeviceMesh API
# ---------------------------------------------------------------------------------------
def test_mesh_api_2d():
    def body():
        m = mesh2d()
        r = m.get_rank()
        tp, dp = m["tp"], m["dp"]
        both, swapped = m[("dp", "tp")], m[("tp", "dp")]
        return dict(
            rank=r, size=m.size(), size0=m.size(0), size1=m.size(1), ndim=m.ndim, shape=m.shape,
            coord=m.get_coordinate(), lr_tp=m.get_local_rank("tp"), lr_dp=m.get_local_rank("dp"),
            lr_1=m.get_local_rank(1), tp_ranks=tp.mesh.tolist(), dp_ranks=dp.mesh.tolist(),
            tp_names=tp.mesh_dim_names, tp_size=tp.size(), tp_lr=tp.get_local_rank(), tp_coord=tp.get_coordinate(),
            both_eq=both == m, swapped=swapped.mesh.tolist(), swapped_names=swapped.mesh_dim_names,
            idx_eq=m[1] == tp,
        )

    res = run_spmd(body, 4, timeout=30.0)
    for r, d in enumerate(res):
        i, j = divmod(r, 2)
        assert d["rank"] == r
        assert (d["size"], d["size0"], d["size1"], d["ndim"], d["shape"]) == (4, 2, 2, 2, (2, 2))
        assert d["coord"] == [i, j]
        assert (d["lr_dp"], d["lr_tp"], d["lr_1"]) == (i, j, j)
        assert d["tp_ranks"] == [2 * i, 2 * i + 1]
        assert d["dp_ranks"] == [j, j + 2]
        assert d["tp_names"] == ("tp",)
        assert (d["tp_size"], d["tp_lr"], d["tp_coord"]) == (2, j, [j])
        assert d["both_eq"]
        assert d["swapped"] == [[0, 2], [1, 3]] and d["swapped_names"] == ("tp", "dp")
        assert d["idx_eq"]


def test_mesh_api_errors():
    def body():
        m = mesh2d()
        errs = {}
        for name, f in [("unknown name", lambda: m["pp"]), ("dim 2", lambda: m[2]),
                        ("local rank no dim", lambda: m.get_local_rank()),
                        ("local rank unknown", lambda: m.get_local_rank("pp")),
                        ("size 5", lambda: m.size(5)), ("repeat", lambda: m[("tp", "tp")])]:
            try:
                f()
                errs[name] = None
            except Exception as e:  # noqa: BLE001
                errs[name] = (type(e), str(e))
        return errs

    errs = run_spmd(body, 4, timeout=30.0)[0]
    assert errs["unknown name"][0] is KeyError and "pp" in errs["unknown name"][1]
    assert errs["dim 2"][0] is IndexError and "2" in errs["dim 2"][1]
    assert errs["local rank no dim"][0] is ValueError
    assert errs["local rank unknown"][0] is KeyError and "pp" in errs["local rank unknown"][1]
    assert errs["size 5"][0] is IndexError and "5" in errs["size 5"][1]
    assert errs["repeat"][0] is ValueError


def test_mesh_equality_and_hash():
    def body():
        a, b = mesh2d(), mesh2d()
        c = init_device_mesh("cpu", (2, 2))
        d = init_device_mesh("cpu", (4,))
        e = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "tp"))
        tp = a["tp"]
        r = a.get_rank()
        own_tp = DeviceMesh("cpu", [2 * (r // 2), 2 * (r // 2) + 1], mesh_dim_names=("tp",))
        table = {a: "a"}
        return dict(ab=a == b, hab=hash(a) == hash(b), ad=a == d, ae=a == e, dict_b=table.get(b),
                    set_len=len({a, b, d, e}), c_hashable=hash(c) is not None, tp_eq=tp == own_tp, tp_hash=hash(tp) == hash(own_tp),
                    tp_repr=repr(tp), neq_obj=a == "mesh", tp_ne_a=tp != a)

    res = run_spmd(body, 4, timeout=30.0)
    for d in res:
        assert d["ab"] and d["hab"] and d["dict_b"] == "a"
        assert not d["ad"] and not d["ae"] and not d["neq_obj"]
        assert d["set_len"] == 3
        assert d["tp_eq"] and d["tp_hash"] and d["tp_ne_a"]
    assert res[0]["tp_repr"] != res[2]["tp_repr"], "ranks 0 and 2 live in different tp sub-meshes"


def test_rank_outside_a_mesh():
    def body():
        m = DeviceMesh("cpu", [0, 1])
        r = m.get_rank()
        out = {"coord": m.get_coordinate()}
        if r >= 2:
            with pytest.raises(RuntimeError, match=str(r)):
                m.get_local_rank()
        return out

    res = run_spmd(body, 4, timeout=30.0)
    assert [d["coord"] for d in res] == [[0], [1], None, None]


def test_dtensor_on_submesh():
    """Each dp row shards its own copy over its tp sub-mesh; full_tensor gives the row's value."""
    def body():
        m = mesh2d()
        i = m.get_local_rank("dp")
        d = distribute_tensor(X + i, m["tp"], [S0], src_data_rank=None)
        return i, (d * 2).full_tensor()

    for i, full in run_spmd(body, 4, timeout=30.0):
        assert torch.equal(full, (X + i) * 2)


@pytest.mark.parametrize("call,exc,pattern", [
    (lambda d, m: d.redistribute(m, [R], forward_dtype="float16"), TypeError, r"forward_dtype must be a torch.dtype.*'float16'"),
    (lambda d, m: d.redistribute(m, [R], backward_dtype=1), TypeError, r"backward_dtype"),
    (lambda d, m: d.redistribute(m, [S0], shard_order=[(0, 0)]), TypeError, r"shard_order must map"),
    (lambda d, m: d.redistribute(m, [S0], shard_order="0"), TypeError, r"shard_order"),
    (lambda d, m: distribute_tensor(X, m, [S0], src_data_rank="0"), TypeError, r"src_data_rank.*'0'"),
    (lambda d, m: distribute_tensor(X, m, [S0], src_data_rank=1.0), TypeError, r"src_data_rank.*1\.0"),
    (lambda d, m: DTensor.from_local(torch.ones(2, 2), m, [S0], shape=(2, -3)), ValueError, r"shape.*\(2, -3\)"),
    (lambda d, m: DTensor.from_local(torch.ones(2, 2), m, [S0], shape=(8, 2.0)), ValueError, r"non-negative ints"),
    (lambda d, m: DTensor.from_local(torch.ones(2, 2), m, [S0], shape=(8,)), ValueError, r"1 dims"),
], ids=["forward_dtype", "backward_dtype", "shard_order_pairs", "shard_order_str", "src_rank_str",
        "src_rank_float", "shape_negative", "shape_float", "shape_ndim"])
def test_argument_errors_name_the_argument(call, exc, pattern):
    def body():
        m = mesh1d()
        call(distribute_tensor(X, m, [S0]), m)

    spmd_raises(exc, body, match=pattern)


def test_shard_order_accepts_pairs():
    def body():
        m = init_device_mesh("cpu", (2, 2))
        d = distribute_tensor(X, m, [S0, S0])
        a = d.redistribute(m, [S0, S0], shard_order={0: [1, 0]})
        b = d.redistribute(m, [S0, S0], shard_order=[(0, [1, 0])])
        return a.shard_order == b.shard_order == ((0, (1, 0)),), torch.equal(a.full_tensor(), X)

    assert all(r == (True, True) for r in run_spmd(body, 4))


# ---------------------------------------------------------------------------------------
# error kinds are told apart by class, and keep the standard bases torch's users catch
# ---------------------------------------------------------------------------------------
def test_every_kind_is_a_sharding_error_with_its_standard_base():
    bases = {errors.UnsupportedOpError: NotImplementedError, errors.PropagationError: RuntimeError,
             errors.MeshMismatchError: ValueError, errors.MixedTensorError: RuntimeError,
             errors.RankAbortedError: RuntimeError, errors.CollectiveMismatchError: RuntimeError,
             errors.CollectiveTimeoutError: TimeoutError, errors.StuckRanksError: TimeoutError}
    for cls, base in bases.items():
        assert issubclass(cls, errors.ShardingError) and issubclass(cls, base), cls
    assert errors.MeshMismatchError is __import__("shardtensor.propagation", fromlist=["x"]).MeshMismatchError
    assert MixedTensorError is errors.MixedTensorError


def test_errors_raised_are_of_their_kind():
    def unsupported():
        d = distribute_tensor(X, mesh1d(), [S0])
        with shardtensor.strict_sharding():
            torch.linalg.lstsq(d, d)

    spmd_raises(errors.UnsupportedOpError, unsupported, match="lstsq")

    def cat_of_scalars():
        d = distribute_tensor(torch.tensor(3.0), mesh1d(), [R])
        torch.cat([d, d])

    spmd_raises(errors.PropagationError, cat_of_scalars, match="zero-dimensional")

    def mismatched():
        return distribute_tensor(X, mesh1d(), [S0]) + distribute_tensor(X, mesh2d(), [S0, R])

    spmd_raises(errors.MeshMismatchError, mismatched)
    spmd_raises(errors.MixedTensorError, lambda: distribute_tensor(X, mesh1d(), [S0]) + torch.ones(5))

    def mismatched_collectives():
        d = distribute_tensor(X, mesh1d(), [S0])
        if d.device_mesh.get_rank() == 0:
            return d.redistribute(d.device_mesh, [R])
        return d.redistribute(d.device_mesh, [S1])

    e = spmd_raises(errors.ShardingError, mismatched_collectives)
    assert isinstance(e, (errors.CollectiveMismatchError, errors.RankAbortedError)), type(e)


def test_a_cached_property_that_runs_a_collective_does_not_deadlock_simulated_ranks():
    """Python 3.11's functools.cached_property locks per property across instances while it
    computes: ranks computing their own instance's value with a collective must not wait on it
    (torch's chunked linear_cross_entropy backward does this)."""
    import functools

    from shardtensor import Shard, distribute_tensor, init_device_mesh, run_spmd

    class Holder:
        def __init__(self, d):
            self.d = d

        @functools.cached_property
        def whole(self):
            return self.d.full_tensor()  # a collective

    def body():
        mesh = init_device_mesh("cpu", (4,))
        return Holder(distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])).whole.sum().item()

    assert run_spmd(body, 4, timeout=20) == [28.0] * 4


def test_an_int_mesh_shape_says_to_write_a_tuple():
    def body():
        with pytest.raises(TypeError, match=r"mesh_shape must be a tuple.*\(4,\)"):
            init_device_mesh("cpu", 4)
        return True
    assert all(run_spmd(body, 4))


def test_a_complex_max_or_min_partial_names_the_placement_and_the_dtype():
    def body():
        mesh = init_device_mesh("cpu", (4,))
        for kind in ("max", "min"):
            with pytest.raises(TypeError, match=rf"Partial\({kind}\).*complex64.*no max or min"):
                DTensor.from_local(torch.ones(3, dtype=torch.complex64), mesh, [Partial(kind)])
        return DTensor.from_local(torch.ones(3, dtype=torch.complex64), mesh, [Partial("avg")]).full_tensor()
    assert all(torch.equal(y, torch.ones(3, dtype=torch.complex64)) for y in run_spmd(body, 4))
