"""The replicate fallback: ops without a sharding rule run on whole tensors, exactly and visibly.

Differential checks against dense torch (forward and backward, meshes (4,) and (2, 2), uneven
lengths, Partial inputs) for ops that have no rule; the warning (once per op, naming op and
bytes), the comm trace, the strict switch (context manager and environment variable), the
write-back of in-place ops into their own placements, and the ops that never fall back
(random ones, and ops on storage).
"""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import shardtensor as st
from opcheck import check, data, gen, make_dtensor, prepare, run_recorded
from shardtensor import CommTrace, Partial, Replicate, Shard, distribute_tensor, errors, init_device_mesh, run_spmd
from shardtensor.dispatch import fallback

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial("sum")
X = data("any", (7, 5), gen("fallback-x"))


@pytest.fixture(autouse=True)
def quiet_fallback():
    """Each test sees the warning afresh and the suite's output stays clean."""
    fallback._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.ReplicateFallbackWarning)
        yield


@pytest.mark.parametrize("mesh", [(4,), (2, 2)], ids=str)
@pytest.mark.parametrize("name,fn,shapes", [
    ("unfold", lambda a: a.unfold(0, 2, 1), [(7, 5)]),
    ("lstsq", lambda a, b: torch.linalg.lstsq(a, b).solution, [(7, 5), (7, 3)]),
    ("pinv", lambda a: torch.linalg.pinv(a), [(7, 5)]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_ops_without_a_rule_match_dense(name, fn, shapes, mesh):
    vals = [data("any", s, gen((name, i))) for i, s in enumerate(shapes)]
    seen = check(fn, vals, mesh, limit=6, tol={"atol": 1e-4, "rtol": 1e-4}, grad_tol={"atol": 1e-3, "rtol": 1e-3})
    outs = [p for _, out in seen for o in out if o is not None for p in (o if isinstance(o, tuple) else (o,))]
    assert outs and all(p == R for p in outs), outs  # the fallback's outputs are Replicate


def test_warning_once_per_op_names_op_and_bytes():
    def body():
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(X, mesh, [S0])
        torch.linalg.lstsq(d, d)
        torch.linalg.lstsq(d, d)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", errors.ReplicateFallbackWarning)
        run_spmd(body, 4)
    msgs = [str(w.message) for w in caught if issubclass(w.category, errors.ReplicateFallbackWarning)]
    assert len(msgs) == 1, msgs  # once for the op, over 4 ranks and 2 calls
    assert "aten.linalg_lstsq.default" in msgs[0] and "(S(0))" in msgs[0]
    assert f"gathering {2 * 7 * 5 * 4} bytes" in msgs[0] and "strict_sharding" in msgs[0]


def test_gathers_are_in_the_comm_trace():
    def body(mesh):
        d = distribute_tensor(X, mesh, [S0, S1])
        with CommTrace() as tr:
            out = torch.linalg.lstsq(d, d).solution
        me = mesh.get_rank()
        return [e for e in tr.events if e.kind != "barrier" and e.rank == me], out.placements

    out, _ = run_recorded((2, 2), body)
    events, placements = out[0]
    assert placements == (R, R)
    assert events and all("fallback aten.linalg_lstsq.default" in e.scope for e in events), events
    assert {e.kind for e in events} == {"all_gather"}


def test_strict_switch_raises_naming_op_and_placements():
    def body():
        mesh = init_device_mesh("cpu", (4,))
        with st.strict_sharding():
            d = distribute_tensor(X, mesh, [S0])
            torch.linalg.lstsq(d, d)

    with pytest.raises(errors.UnsupportedOpError, match=r"lstsq.*S\(0\)"):
        run_spmd(body, 4)


def test_strict_environment_variable():
    code = ("import torch, shardtensor as st\n"
            "from shardtensor import Shard, distribute_tensor, init_device_mesh, run_spmd\n"
            "def body():\n"
            "    d = distribute_tensor(torch.ones(8, 4), init_device_mesh('cpu', (2,)), [Shard(0)])\n    torch.linalg.lstsq(d, d)\n"
            "try:\n"
            "    run_spmd(body, 2)\n"
            "    print('ran')\n"
            "except NotImplementedError as e:\n"
            "    print('raised', type(e).__name__)\n")
    env = {**__import__("os").environ, "SHARDTENSOR_STRICT": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "raised UnsupportedOpError", out.stdout + out.stderr


IN_PLACE = [  # scatter_ with a reduce string: no rule (the fallback); put_: a rule that needs self R
    ("scatter_reduce", lambda t, i, v: t.scatter_(0, i.reshape(1, 4) % 7, v.reshape(1, 4), reduce="add")),
    ("put_", lambda t, i, v: t.put_(i, v)),
]


@pytest.mark.parametrize("name,fn", IN_PLACE, ids=[n for n, _ in IN_PLACE])
@pytest.mark.parametrize("placements", [(S0,), (S1,), (P,), (R,)], ids=str)
def test_in_place_op_writes_back_in_its_own_placements(placements, name, fn):
    """An in-place op on a sharded self, run whole: the result lands back as self's shards, in
    self's own memory."""
    idx = torch.tensor([0, 9, 33, 4])
    vals = torch.tensor([1.5, -2.0, 3.25, 8.0])
    expected = fn(X.clone(), idx, vals)

    def body():
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(X, mesh, list(placements))
        local_before = d._local_tensor
        with st.implicit_replication(), warnings.catch_warnings():  # every rank holds the same index and values
            warnings.simplefilter("ignore", UserWarning)  # scatter's reduce string is deprecated
            out = fn(d, idx, vals)
        return out is d, d.placements, d._local_tensor is local_before, d.full_tensor()

    for same, pls, kept_memory, full in run_spmd(body, 4):
        assert same and torch.equal(full, expected) and pls == placements and kept_memory


def test_data_dependent_shapes_run_whole():
    def body(mesh):
        t = distribute_tensor(X, mesh, [S0])
        return [(r.placements, r.full_tensor()) for r in (torch.nonzero(t), torch.masked_select(t, t > 0), t[t > 0])]

    out, _ = run_recorded((4,), body)
    for (pls, full), dense in zip(out[0], [torch.nonzero(X), torch.masked_select(X, X > 0), X[X > 0]]):
        assert pls == (R,) and torch.equal(full, dense)


def test_storage_ops_and_random_ops_without_a_generator_never_fall_back():
    assert not fallback.fallback_allowed(torch.ops.aten.native_dropout.default)
    assert fallback.fallback_allowed(torch.ops.aten.poisson.default)  # drawn with an agreed generator
    assert not fallback.fallback_allowed(torch.ops.aten.as_strided.default)
    assert fallback.fallback_allowed(torch.ops.aten.linalg_lstsq.default)

    def body():
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(X, mesh, [S1])
        d.set_(distribute_tensor(torch.zeros(3), mesh, [S0]))

    with pytest.raises(NotImplementedError, match="set_"):
        run_spmd(body, 4)


def test_out_variant_writes_into_out_in_its_placements():
    expected = torch.linalg.pinv(X)

    def body():
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(X, mesh, [S0])
        o = distribute_tensor(torch.zeros(5, 7), mesh, [S1])
        r = torch.linalg.pinv(d, out=o)
        return r is o, o.placements, o.full_tensor()

    for same, pls, full in run_spmd(body, 4):
        assert same and pls == (S1,)
        torch.testing.assert_close(full, expected, atol=1e-5, rtol=1e-5)


def test_a_random_op_without_a_rule_draws_one_devices_numbers_on_every_rank():
    """poisson and normal(mean, std) have no rule: they run on the whole tensors from one generator
    state every rank agrees on, so the result is one device's draw and replicas agree, even when
    the ranks' own generators differ (coordinate 0's state is used)."""
    lam = X.abs() * 3

    def body(seed_by_rank):
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(1 + (mesh.get_rank() if seed_by_rank else 0))
        p = torch.poisson(distribute_tensor(lam, mesh, [S0]))
        n = torch.normal(distribute_tensor(X, mesh, [S1]), distribute_tensor(lam + 0.1, mesh, [R]))
        return p.placements, p.full_tensor(), n.full_tensor()

    torch.manual_seed(1)
    want = torch.poisson(lam), torch.normal(X, lam + 0.1)
    for seed_by_rank in (False, True):
        for pl, p, n in run_spmd(body, 4, seed_by_rank):
            assert pl == (R,) and torch.equal(p, want[0]) and torch.equal(n, want[1]), seed_by_rank


def pinv_product(a, b):
    return torch.linalg.pinv(a).t() @ torch.linalg.pinv(b)


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
def test_fallback_in_gloo_processes():
    from distributed import gloo_available

    if not gloo_available():
        pytest.skip("gloo not available")
    a, b = data("any", (7, 5), gen("gloo-a")), data("any", (3, 5), gen("gloo-b"))
    seen = check(pinv_product, [a, b], (4,), world="gloo", combos=[((S0,), (P,)), ((S1,), (S0,))],
                 tol={"atol": 1e-4, "rtol": 1e-4}, grad_tol={"atol": 1e-3, "rtol": 1e-3})
    assert all(out == ((R,),) or out == (R,) for _, out in seen), seen


def test_plain_outputs_of_a_decomposition_are_replicated():
    """A decomposition may build an output with a factory (an empty ``repeat``, batch norm's
    reserve): every rank builds it alike, so it comes back as a ``Replicate`` DTensor."""
    def body():
        mesh = init_device_mesh("cpu", (4,))
        r = distribute_tensor(torch.ones(0), mesh, [S0]).repeat(0)
        x = distribute_tensor(X.reshape(7, 5, 1), mesh, [S0])
        w = distribute_tensor(torch.ones(5), mesh, [R])
        outs = torch.ops.aten._batch_norm_with_update(x, w, w, torch.zeros(5), torch.ones(5), 0.5, 0.6)
        return [(type(o).__name__, o.placements if isinstance(o, st.DTensor) else None) for o in (r, *outs)]

    got = run_spmd(lambda: _in_implicit(body), 4)[0]  # the running stats are plain, alike on every rank
    assert [t for t, _ in got] == ["DTensor"] * 5, got
    assert got[0][1] == (R,) and got[4][1] == (R,)


def _in_implicit(fn):
    with st.implicit_replication():
        return fn()


def test_as_strided_of_a_replicated_tensor_runs_locally():
    expected = X.as_strided((2, 3), (1, 2))

    def body():
        d = distribute_tensor(X, init_device_mesh("cpu", (4,)), [R])
        out = torch.as_strided(d, (2, 3), (1, 2))
        return out.placements, out.to_local()

    for pls, local in run_spmd(body, 4):
        assert pls == (R,) and torch.equal(local, expected)


@pytest.mark.parametrize("pl", [R, S0, S1, P], ids=str)
def test_stride_reading_ops_fall_back_on_global_strides(pl):
    """``as_strided_scatter`` and ``as_strided_copy`` read the input's strides: the fallback's
    whole tensor is laid out with the global ones, whatever the local pieces' layout."""
    x = torch.arange(12.0).reshape(3, 4).t()  # (4, 3), strides (1, 4)
    src = -torch.ones(2, 2)
    want_scatter = torch.as_strided_scatter(x, src, (2, 2), (1, 2), 1)
    want_copy = torch.as_strided_copy(x, (2, 2), (1, 4), 2)
    case = prepare([x, src], [(pl,), (R,)], (4,), gen("strided"))

    def body():
        mesh = init_device_mesh("cpu", (4,))
        d, s = (make_dtensor(p, mesh, False) for p in case)
        return (torch.as_strided_scatter(d, s, (2, 2), (1, 2), 1).full_tensor(),
                torch.as_strided_copy(d, (2, 2), (1, 4), 2).full_tensor())

    for scatter, copy in run_spmd(body, 4):
        assert torch.equal(scatter, want_scatter) and torch.equal(copy, want_copy)
