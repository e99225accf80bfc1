"""Asynchronous collectives (``async_op=True``) and ``AsyncLocalTensor``.

Oracle: every rank's input is built from a fixed seed and its rank, so each rank can compute
every collective's result locally (integer values stored as float32 or int64, so sums,
averages over 2 or 4, products and extrema are exact).  Each async result must equal both
the oracle and the synchronous call.

Sections: ``Work`` itself; the simulated world (equalities over groups of 1, 2, 4, the groups
of a (2,2) mesh and groups in a non-ascending order; several collectives in flight; ordering
against synchronous calls; failure and timeout); real gloo processes (one spawned run, the
same checks); ``AsyncLocalTensor``.
"""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from shardtensor import Replicate, Shard, comm, distribute_tensor, init_device_mesh, run_spmd
from shardtensor.async_tensor import AsyncLocalTensor, wait_tensor
from shardtensor.comm import (CollectiveMismatchError, CollectiveTimeoutError, RankAbortedError,
                              StuckRanksError)
from shardtensor.comm.base import Completed, Work, reduce_stack

try:
    from distributed import gloo_available, run_multiprocess
except ImportError:  # tests/ imported as a package
    from tests.distributed import gloo_available, run_multiprocess

WORLD = 4
OPS = ["sum", "avg", "max", "min", "product"]


# ---------------------------------------------------------------------------------------
# cases shared by the simulated world and the gloo processes (top-level, importable)
# ---------------------------------------------------------------------------------------

def _input(rank, seed, shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    lo, hi = (1, 4) if seed % 2 else (-9, 10)  # odd seeds: small positive values for products
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def _groups(rank, mesh1, mesh2):
    """(name, group) pairs: size 1, both dims of the (2,2) mesh, size 4, and reversed orders."""
    g4 = mesh1.group_ranks(0)
    return [
        ("self", (rank,)),
        ("(2,2) dim 0", mesh2.group_ranks(0)),
        ("(2,2) dim 1", mesh2.group_ranks(1)),
        ("(4,)", g4),
        ("(4,) reversed", tuple(reversed(g4))),
        ("(2,2) dim 1 reversed", tuple(reversed(mesh2.group_ranks(1)))),
    ]


def _collectives(rank, group, seed):
    """(name, call, oracle) for every collective and op over ``group``, as seen by ``rank``."""
    me = group.index(rank)
    k = len(group)
    cases = []
    for dtype in (torch.float32, torch.int64):
        shape = (3, 5)
        ins = [_input(r, seed, shape, dtype) for r in group]
        mine = ins[me]
        cases.append((f"all_gather {dtype}", ("all_gather", mine), torch.stack(ins)))
        cases.append((f"all_gather transposed {dtype}", ("all_gather", mine.t()),
                      torch.stack([x.t() for x in ins])))
        ops = OPS if dtype is torch.float32 else ["sum", "avg", "max"]
        for op in ops:
            src = [_input(r, seed + 1, shape, dtype) for r in group] if op == "product" else ins
            cases.append((f"all_reduce {op} {dtype}", ("all_reduce", src[me], op), reduce_stack(torch.stack(src), op)))
        blocks = [_input(r, seed + 2, (k, 2, 3), dtype) for r in group]
        for op in ("sum", "avg", "max", "min"):
            cases.append((f"reduce_scatter {op} {dtype}", ("reduce_scatter", blocks[me], op),
                          reduce_stack(torch.stack([b[me] for b in blocks]), op)))
        cases.append((f"all_to_all {dtype}", ("all_to_all", blocks[me]), torch.stack([b[me] for b in blocks])))
    return cases


def _call(tr, call, group, async_op):
    kind, t, *op = call
    fn = getattr(tr, kind)
    return fn(t, *op, group, async_op=True) if async_op else fn(t, *op, group)


def _mismatch(what, got, want):
    if not isinstance(got, torch.Tensor) or type(got) is not torch.Tensor:
        return f"{what}: result is {type(got).__name__}, not a plain tensor"
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        return f"{what}: got {got.dtype} {tuple(got.shape)}\n{got}\nexpected {want.dtype} {tuple(want.shape)}\n{want}"
    return None


def _check_equalities(rank, mesh1, mesh2):
    """Every collective, async and sync, over every group: all async issued first, then waited."""
    tr = mesh1.transport
    bad = []
    for gname, group in _groups(rank, mesh1, mesh2):
        cases = _collectives(rank, group, seed=len(gname))
        works = [_call(tr, call, group, True) for _, call, _ in cases]
        syncs = [_call(tr, call, group, False) for _, call, _ in cases]
        for (name, _, want), w, s in zip(cases, works, syncs):
            what = f"{name} over {gname} {group}"
            if not isinstance(w, Work):
                bad.append(f"{what}: async_op=True returned {type(w).__name__}, not a Work")
                continue
            if len(group) > 1 and isinstance(w, Completed):
                bad.append(f"{what}: a group of {len(group)} returned a Completed work")
            got = w.wait()
            if w.wait() is not got:
                bad.append(f"{what}: a second wait returned another object")
            if not w.is_completed():
                bad.append(f"{what}: is_completed() is False after wait")
            for label, t in (("async", got), ("sync", s)):
                m = _mismatch(f"{what} ({label})", t, want)
                if m:
                    bad.append(m)
    return bad


def _check_in_flight(rank, mesh1, mesh2):
    """Several collectives on several groups in flight at once, waited in reverse order."""
    tr = mesh1.transport
    g4, ga, gb = mesh1.group_ranks(0), mesh2.group_ranks(0), mesh2.group_ranks(1)
    plan = []
    for i, group in enumerate([g4, ga, g4, gb, g4, ga, gb]):
        name, call, want = _collectives(rank, group, seed=40 + i)[(5 * i) % 11]
        plan.append((f"#{i} {name} over {group}", call, group, want))
    works = [_call(tr, call, group, True) for _, call, group, _ in plan]
    bad = []
    for (what, _, _, want), w in reversed(list(zip(plan, works))):
        m = _mismatch(what, w.wait(), want)
        if m:
            bad.append(m)
    return bad


def _check_sync_between(rank, mesh1, mesh2):
    """A synchronous collective between an async one's issue and its wait stays in order.

    Rank 0 waits before its synchronous call, the others after: the async all-gather is
    matched by issue order, not by wait order.
    """
    tr = mesh1.transport
    bad = []
    for group in (mesh1.group_ranks(0), mesh2.group_ranks(1)):
        (n1, c1, want1), (n2, c2, want2) = _collectives(rank, group, seed=60)[0], _collectives(rank, group, seed=61)[2]
        w = _call(tr, c1, group, True)
        early = w.wait() if rank == 0 else None
        s = _call(tr, c2, group, False)
        late = w.wait()
        if early is not None and early is not late:
            bad.append("wait() returned another object the second time")
        for what, got, want in ((f"async {n1} over {group}", late, want1), (f"sync {n2} over {group}", s, want2)):
            m = _mismatch(what, got, want)
            if m:
                bad.append(m)
    return bad


# ---------------------------------------------------------------------------------------
# Work
# ---------------------------------------------------------------------------------------

class _Counting:
    def __init__(self, value):
        self.value = value
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return self.value


def test_work_waits_once_and_returns_the_same_object():
    fn = _Counting(torch.arange(4.0))
    posts = []
    w = Work(fn, lambda: False, lambda t: posts.append(1) or t * 2)
    assert not w.is_completed()
    assert "pending" in repr(w)
    a, b = w.wait(), w.wait()
    assert a is b and torch.equal(a, torch.arange(4.0) * 2)
    assert fn.calls == 1 and posts == [1]
    assert w.is_completed() and "done" in repr(w)


def test_work_then_chains_lazily():
    fn = _Counting(torch.ones(3))
    w = Work(fn, lambda: True)
    chained = w.then(lambda t: t + 1).then(lambda t: t * 10)
    assert fn.calls == 0 and chained.is_completed()
    assert torch.equal(chained.wait(), torch.full((3,), 20.0))
    assert chained.wait() is chained.wait()
    assert fn.calls == 1 and torch.equal(w.wait(), torch.ones(3))


def test_work_error_is_kept():
    calls = []

    def boom():
        calls.append(1)
        raise ValueError("peer gone")

    w = Work(boom)
    for _ in range(2):
        with pytest.raises(ValueError, match="peer gone"):
            w.wait()
    assert calls == [1] and w.is_completed() and "failed" in repr(w)


def test_work_wait_from_many_threads_runs_once():
    gate = threading.Event()
    fn = _Counting(torch.zeros(2))

    def slow():
        gate.wait(5)
        return fn()

    w = Work(slow)
    out = []
    threads = [threading.Thread(target=lambda: out.append(w.wait())) for _ in range(4)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(5)
    assert len(out) == 4 and all(o is out[0] for o in out) and fn.calls == 1


def test_completed():
    t = torch.arange(3)
    w = Completed(t)
    assert w.is_completed() and w.wait() is t and w.wait() is t
    assert w.then(lambda x: x + 1).wait().tolist() == [1, 2, 3]


# ---------------------------------------------------------------------------------------
# the simulated world
# ---------------------------------------------------------------------------------------

def _sim_rank(check):
    from shardtensor.comm import current_transport

    mesh1 = init_device_mesh("cpu", (WORLD,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    return check(current_transport().rank, mesh1, mesh2)


@pytest.mark.parametrize("check", [_check_equalities, _check_in_flight, _check_sync_between],
                         ids=["equalities", "in_flight_reverse_wait", "sync_between_issue_and_wait"])
def test_sim(check):
    for rank, bad in enumerate(run_spmd(_sim_rank, WORLD, check, timeout=20)):
        assert not bad, f"rank {rank}:\n" + "\n\n".join(bad)


def test_sim_issue_deposits_at_once():
    """After a barrier that follows the issue, every async collective on the group is complete
    without any rank having waited: the payload was deposited when the collective was issued."""

    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        tr, g = mesh.transport, mesh.group_ranks(0)
        works = [tr.all_gather(torch.full((2,), float(tr.rank)), g, async_op=True),
                 tr.all_reduce(torch.ones(3), "sum", g, async_op=True)]
        tr.barrier(g)
        done = [w.is_completed() for w in works]
        return done, works[0].wait().tolist(), works[1].wait().tolist()

    for done, ag, ar in run_spmd(fn, WORLD, timeout=20):
        assert done == [True, True]
        assert ag == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]] and ar == [4.0, 4.0, 4.0]


def test_sim_async_input_is_taken_at_issue():
    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        tr = mesh.transport
        t = torch.full((2,), float(tr.rank))
        w = tr.all_gather(t, mesh.group_ranks(0), async_op=True)
        t.fill_(-1)
        return w.wait()[:, 0].tolist()

    for got in run_spmd(fn, WORLD, timeout=20):
        assert got == [0.0, 1.0, 2.0, 3.0]


def test_sim_rank_failure_ends_the_waiters():
    """Rank 0 raises before issuing; ranks that issued and wait get RankAbortedError quickly."""
    seen = {}

    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        tr, g = mesh.transport, mesh.group_ranks(0)
        if tr.rank == 0:
            time.sleep(0.2)
            raise ValueError("rank 0 broke")
        w1 = tr.all_gather(torch.ones(2), g, async_op=True)
        w2 = tr.reduce_scatter(torch.ones(WORLD, 2), "sum", g, async_op=True)
        t0 = time.monotonic()
        for i, w in enumerate((w2, w1)):
            try:
                w.wait()
            except RankAbortedError as e:
                seen[(tr.rank, i)] = (time.monotonic() - t0, e)

    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 0 broke"):
        run_spmd(fn, WORLD, timeout=10)
    assert time.monotonic() - start < 5
    assert sorted(seen) == [(r, i) for r in range(1, WORLD) for i in (0, 1)]
    assert all(dt < 5 for dt, _ in seen.values())


def test_sim_missing_rank_times_out():
    """A rank that never issues: the waiters raise CollectiveTimeoutError after the timeout."""

    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        tr, g = mesh.transport, mesh.group_ranks(0)
        if tr.rank == 3:
            return None
        w = tr.all_to_all(torch.ones(WORLD, 1), g, async_op=True)
        time.sleep(0.1)
        t0 = time.monotonic()
        try:
            w.wait()
        except CollectiveTimeoutError as e:
            return time.monotonic() - t0, str(e)
        return None

    results = run_spmd(fn, WORLD, timeout=0.5)
    assert results[3] is None
    for dt, msg in results[:3]:
        assert 0.45 < dt < 5
        assert "all_to_all #0 over ranks (0, 1, 2, 3) timed out after 0.5s: ranks [3] never arrived (3/4 did)" in msg


def test_sim_sleeping_rank_cannot_hang_run_spmd():
    """A rank that never reaches the collective (it sleeps): run_spmd returns soon after the
    timeout with the waiter's error, naming the missing rank and the collective, and a note
    saying where the sleeper is."""
    release = threading.Event()

    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        if mesh.get_rank() == 2:
            release.wait(60)  # stands for a rank stuck in user code
        comm.all_reduce(torch.ones(2), "sum", mesh, 0)

    start = time.monotonic()
    try:
        with pytest.raises(CollectiveTimeoutError) as info:
            run_spmd(fn, WORLD, timeout=1.0)
        assert time.monotonic() - start < 6
        msg = str(info.value)
        assert "all_reduce #0 over ranks (0, 1, 2, 3) timed out after 1.0s: ranks [2] never arrived" in msg
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "ranks [2] were still running after the world failed" in notes and "in fn" in notes
    finally:
        release.set()


def test_sim_spinning_rank_after_the_others_returned():
    """The other ranks returned and one spins outside any collective: StuckRanksError names it."""
    release = threading.Event()

    def fn():
        mesh = init_device_mesh("cpu", (2,))
        while mesh.get_rank() == 1 and not release.is_set():
            pass
        return mesh.get_rank()

    start = time.monotonic()
    try:
        with pytest.raises(StuckRanksError, match=r"ranks \[1\] were still running 0.5s after another rank returned"):
            run_spmd(fn, 2, timeout=0.5)
        assert time.monotonic() - start < 5
    finally:
        release.set()


def test_sim_ranks_issuing_different_collectives_fail_at_once():
    """Rank 1 all-gathers where rank 0 all-reduces: an error naming both, not mixed payloads."""

    def fn():
        mesh = init_device_mesh("cpu", (2,))
        if mesh.get_rank() == 0:
            return comm.all_reduce(torch.ones(2), "sum", mesh, 0)
        time.sleep(0.2)
        return comm.all_gather(torch.ones(2), mesh, 0)

    start = time.monotonic()
    with pytest.raises(CollectiveMismatchError, match="rank 1 called all_gather where rank 0 called all_reduce"):
        run_spmd(fn, 2, timeout=30)
    assert time.monotonic() - start < 5


def test_sim_backward_runs_on_the_rank_thread():
    """Each simulated rank runs autograd single-threaded, so on CUDA its backward (and the
    collectives inside it) stays on the rank's own thread instead of torch's shared device thread."""

    def fn():
        seen = []
        x = torch.ones(2, requires_grad=True)
        y = x * 2
        y.register_hook(lambda g: seen.append(threading.current_thread().name) or g)
        y.sum().backward()
        return torch.autograd.is_multithreading_enabled(), seen, threading.current_thread().name

    for enabled, seen, me in run_spmd(fn, 2):
        assert enabled is False and seen == [me]
    assert torch.autograd.is_multithreading_enabled()


def test_sim_ops_wait_once_through_async_tensor():
    """An async all-gather wrapped as AsyncLocalTensor: metadata before wait, values after."""

    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        tr, g = mesh.transport, mesh.group_ranks(0)
        t = torch.full((3,), float(tr.rank))
        a = AsyncLocalTensor(tr.all_gather(t, g, async_op=True), (WORLD, 3), t.dtype, t.device)
        meta = (tuple(a.shape), a.dtype, a.stride())
        out = (a * 2).sum(1)
        return meta, out.tolist(), type(out) is torch.Tensor, a.tolist()

    for meta, out, plain, full in run_spmd(fn, WORLD, timeout=20):
        assert meta == ((WORLD, 3), torch.float32, (3, 1))
        assert out == [0.0, 6.0, 12.0, 18.0] and plain
        assert full == [[float(r)] * 3 for r in range(WORLD)]


# ---------------------------------------------------------------------------------------
# real gloo processes: one spawned run for every check
# ---------------------------------------------------------------------------------------

def _gloo_worker(rank, world_size):
    from shardtensor.comm.torchdist import TorchDistTransport

    assert world_size == WORLD
    mesh1 = init_device_mesh("cpu", (WORLD,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    assert isinstance(mesh1.transport, TorchDistTransport), type(mesh1.transport)
    report = {}
    for name, check in (("equalities", _check_equalities), ("in_flight", _check_in_flight),
                        ("sync_between", _check_sync_between)):
        report[name] = check(rank, mesh1, mesh2)
    return report


@pytest.fixture(scope="module")
def gloo_report():
    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return run_multiprocess(_gloo_worker, world_size=WORLD, timeout=90, env={"SHARDTENSOR_COMM_TIMEOUT": "20"})


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
@pytest.mark.parametrize("section", ["equalities", "in_flight", "sync_between"])
def test_gloo(gloo_report, section):
    for rank, report in enumerate(gloo_report):
        bad = report[section]
        assert not bad, f"rank {rank}, {len(bad)} failures:\n" + "\n\n".join(bad)


# ---------------------------------------------------------------------------------------
# AsyncLocalTensor
# ---------------------------------------------------------------------------------------

def _pending(value):
    fn = _Counting(value)
    return AsyncLocalTensor(Work(fn, lambda: fn.calls > 0), value.shape, value.dtype, value.device), fn


def test_async_tensor_metadata_before_wait():
    a, fn = _pending(torch.arange(6.0).reshape(2, 3))
    assert isinstance(a, torch.Tensor) and isinstance(a, AsyncLocalTensor)
    assert a.shape == (2, 3) and a.dtype == torch.float32 and a.device == torch.device("cpu")
    assert a.stride() == (3, 1) and a.numel() == 6 and a.dim() == 2 and not a.requires_grad
    assert not a.is_completed()
    assert "pending" in repr(a) and fn.calls == 0


def test_async_tensor_ops_wait_once():
    real = torch.arange(6.0).reshape(2, 3)
    a, fn = _pending(real)
    b = a + 1
    assert type(b) is torch.Tensor and torch.equal(b, real + 1)
    assert torch.equal(a.clone(), real) and torch.equal(a, real) and torch.equal(real, a)
    assert a.tolist() == real.tolist() and (a.numpy() == real.numpy()).all()
    assert a.sum().item() == 15.0 and float(a[1, 2]) == 5.0 and a[0].tolist() == [0.0, 1.0, 2.0]
    assert torch.equal(torch.cat([a, real]), torch.cat([real, real]))
    assert torch.equal(torch.matmul(a, a.t()), real @ real.t())
    assert fn.calls == 1
    assert a.wait() is real and wait_tensor(a) is real and a.is_completed()
    assert "pending" not in repr(a) and "5." in repr(a)
    assert fn.calls == 1


def test_async_tensor_printing_and_formatting():
    a, _ = _pending(torch.tensor([1.5, 2.5]))
    assert str(a) == str(torch.tensor([1.5, 2.5]))
    s, _ = _pending(torch.tensor(3.25))
    assert f"{s:.1f}" == "3.2" and s.item() == 3.25


def test_async_tensor_with_autograd_around_it():
    a, fn = _pending(torch.tensor([1.0, 2.0, 3.0]))
    x = torch.ones(3, requires_grad=True)
    (x * a).sum().backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 2.0, 3.0]))
    with torch.no_grad():
        y = a * 2
    assert type(y) is torch.Tensor and y.tolist() == [2.0, 4.0, 6.0] and fn.calls == 1


def test_async_tensor_in_place_and_copy():
    import copy
    import pickle

    real = torch.zeros(2)
    a, _ = _pending(real)
    a.add_(1)
    assert real.tolist() == [1.0, 1.0]
    c = copy.deepcopy(a)
    assert type(c) is torch.Tensor and c.tolist() == [1.0, 1.0] and c is not real
    p = pickle.loads(pickle.dumps(a))
    assert type(p) is torch.Tensor and p.tolist() == [1.0, 1.0]


def test_async_tensor_wrong_result_is_reported():
    a = AsyncLocalTensor(Completed(torch.zeros(3)), (2,), torch.float32)
    with pytest.raises(RuntimeError, match="promised"):
        a.wait()


def test_wait_tensor_passes_plain_tensors_through():
    t = torch.ones(2)
    assert wait_tensor(t) is t
    assert AsyncLocalTensor.like(Completed(t), t).wait() is t


# -- DTensor.redistribute(async_op=True) ----------------------------------------------------------

def _redistribute_async(mesh_shape, shape, src, dst):
    from shardtensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x = distribute_tensor(full, mesh, src)
    sync = x.redistribute(mesh, dst)
    y = x.redistribute(mesh, dst, async_op=True)
    local = y.to_local()
    kind = type(local).__name__
    out = {
        "kind": kind,
        "shape_known": tuple(local.shape) == tuple(sync.to_local().shape),
        "equal": torch.equal(wait_tensor(local), sync.to_local()),
        "op": torch.equal((y * 2).to_local(), sync.to_local() * 2),
        "full": torch.equal(y.full_tensor(), full),
        "placements": y.placements == sync.placements,
    }
    # autograd through an async redistribution
    xg = distribute_tensor(full, mesh, src).detach().requires_grad_()
    (xg.redistribute(mesh, dst, async_op=True) * 3).sum().backward()
    out["grad"] = torch.equal(xg.grad.full_tensor(), torch.full(shape, 3.0))
    return out


@pytest.mark.parametrize("mesh_shape,shape,src,dst,kind", [
    ((4,), (7, 3), "S0", "R", "AsyncLocalTensor"),
    ((4,), (7, 6), "S0", "S1", "AsyncLocalTensor"),
    ((4,), (7, 3), "R", "S0", "Tensor"),                      # no collective: finished at once
    ((2, 2), (7, 5), "S0,S1", "R,R", "AsyncLocalTensor"),     # two steps: the last stays in flight
    ((2, 2), (8, 4), "S0,S0", "R,R", "AsyncLocalTensor"),     # one all-gather over the flattened group
    ((2, 2), (7, 4), "S0,S0", "R,S0", "AsyncLocalTensor"),    # one direct exchange (unpadded all-to-all)
])
def test_dtensor_redistribute_async(mesh_shape, shape, src, dst, kind):
    from shardtensor.redistribute.explain import parse_placements

    m = len(mesh_shape)
    res = run_spmd(_redistribute_async, math.prod(mesh_shape), mesh_shape, shape,
                   list(parse_placements(src, m)), list(parse_placements(dst, m)))
    for r in res:
        assert r["kind"] == kind, r
        assert all(v for k, v in r.items() if k != "kind"), r


def _gloo_redistribute_async(rank, world):
    from shardtensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    full = torch.randn(256, 64)
    x = distribute_tensor(full, mesh, [Shard(0)])
    y = x.redistribute(mesh, [Replicate()], async_op=True)
    issued = type(y.to_local()).__name__
    busy = torch.randn(128, 128) @ torch.randn(128, 128)  # work while the all-gather runs
    ok = torch.equal(y.to_local().wait(), full) and torch.equal((y + 0).to_local(), full)
    z = x.redistribute(mesh, [Shard(1)], async_op=True)
    ok_a2a = torch.equal(wait_tensor(z.to_local()), full[:, rank * 16:(rank + 1) * 16])
    mesh2 = init_device_mesh("cpu", (2, 2))
    e = distribute_tensor(full[:7], mesh2, [Shard(0), Shard(0)]).redistribute(mesh2, [Replicate(), Shard(0)],
                                                                             async_op=True)
    c1 = mesh2.get_coordinate()[1]
    ok_ex = type(e.to_local()).__name__ == "AsyncLocalTensor" and torch.equal(
        wait_tensor(e.to_local()), full[:7][: 4] if c1 == 0 else full[4:7])
    return issued, ok and ok_ex, ok_a2a, busy.shape


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
@pytest.mark.skipif(not gloo_available(), reason="torch.distributed gloo backend not available")
def test_gloo_dtensor_redistribute_async():
    for issued, ok, ok_a2a, _ in run_multiprocess(_gloo_redistribute_async, world_size=4, timeout=120):
        assert issued == "AsyncLocalTensor" and ok and ok_a2a


def test_async_collectives_are_recorded_in_a_log_opened_inside_the_rank():
    """A log opened inside run_spmd keeps its world's events; async ones carry the world too."""
    def fn():
        mesh = init_device_mesh("cpu", (WORLD,))
        x = distribute_tensor(torch.ones(8, 2), mesh, [Shard(0)])
        with comm.recording() as log:
            y = x.redistribute(mesh, [Replicate()], async_op=True)
            y.to_local().wait()
        return [e.kind for e in log.events if e.rank == mesh.get_rank()]

    assert run_spmd(fn, WORLD) == [["all_gather"]] * WORLD
