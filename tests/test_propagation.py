"""The propagation engine: cache keys, selection, errors.

Rules of real op families have their own test files (tests/test_ops_*.py); here test-only ops
defined with ``torch.library`` give full control over the candidates a rule offers.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh, run_spmd
from shardtensor.propagation import (Candidate, Decision, MeshMismatchError, _freeze, cache_info, clear_cache, decide,
                                     register)
import shardtensor.propagation.call as call_module
from shardtensor.propagation.call import Call, flatten_call
from shardtensor import strict_sharding

TIMEOUT = 30.0

_lib = torch.library.Library("sttest", "DEF")
_lib.define("pick(Tensor x) -> Tensor")
_lib.define("pick2(Tensor x, Tensor y) -> Tensor")
_lib.define("shardby(Tensor x, int d) -> Tensor")
_lib.define("norule(Tensor x) -> Tensor")
_lib.define("infeasible(Tensor x) -> Tensor")
for name in ("pick", "norule", "infeasible"):
    _lib.impl(name, lambda x: x.clone(), "CompositeExplicitAutograd")
_lib.impl("pick2", lambda x, y: x + y, "CompositeExplicitAutograd")
_lib.impl("shardby", lambda x, d: x.clone(), "CompositeExplicitAutograd")
st = torch.ops.sttest

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial("sum")
CALLS = {"pick": 0}


@register(st.pick.default)
def _pick_rule(call):
    """Offer 'input S(0) -> output S(0)' first, then 'input R -> output R'."""
    CALLS["pick"] += 1
    x = call.pos("x")
    return [Candidate({x: (S0,)}, (S0,)), Candidate({x: (R,)}, (R,))]


@register(st.pick2.default)
def _pick2_rule(call):
    x, y = call.pos("x"), call.pos("y")
    return [Candidate({x: (S0,), y: (S0,)}, (S0,)), Candidate({x: (S1,), y: (S1,)}, (S1,))]


@register(st.shardby.default)
def _shardby_rule(call):
    """Output sharded on the dim given as a plain int: the int must be part of the cache key."""
    d = call.arg("d")
    return [Candidate({call.pos("x"): (Shard(d),)}, (Shard(d),))]


@register(st.infeasible.default)
def _infeasible_rule(call):
    return [Candidate({call.pos("x"): (Partial("sum"),)}, (R,))]


def spmd(fn, world=4):
    return run_spmd(fn, world, timeout=TIMEOUT)


def _from_terms(full: torch.Tensor, mesh, placements):
    """A DTensor of value ``full`` with Partial(sum) terms (rank 0 holds the value, others 0)."""
    coord = mesh.get_coordinate()
    local = full.clone() if all(c == 0 for c in coord) else torch.zeros_like(full)
    return DTensor.from_local(local, mesh, placements, shape=full.shape)


# -- selection -----------------------------------------------------------------------------

def test_replicated_input_prefers_no_movement():
    """#9: R input, candidates S(0) and R both cost 0 -> R (nothing moves)."""
    def body():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.arange(8.0), mesh, [R])
        y = st.pick(x)
        return y.placements, y.full_tensor()

    for pl, full in spmd(body):
        assert pl == (R,)
        assert torch.equal(full, torch.arange(8.0))


def test_partial_input_prefers_reduce_scatter():
    """#10: P(sum) input, candidates needing S(0) and R -> S(0) (reduce-scatter moves fewer bytes)."""
    def body():
        mesh = init_device_mesh("cpu", (4,))
        x = _from_terms(torch.arange(8.0), mesh, [P])
        with comm.recording() as log:
            y = st.pick(x)
        kinds = [e.kind for e in log.events if e.rank == comm.current_transport().rank]
        return y.placements, y.full_tensor(), kinds

    for pl, full, kinds in spmd(body):
        assert pl == (S0,)
        assert torch.equal(full, torch.arange(8.0))
        assert kinds == ["reduce_scatter"]


def test_ties_are_deterministic():
    """#11: equal-cost candidates -> the first listed, on every rank and every run."""
    def body():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.ones(8, 8), mesh, [R])
        y = distribute_tensor(torch.ones(8, 8), mesh, [R])
        return st.pick2(x, y).placements

    for _ in range(2):
        clear_cache()
        assert set(spmd(body)) == {(S0,)}


def test_infinite_cost_raises_naming_op_and_placements():
    """#12: every candidate unreachable (Shard -> Partial) -> RuntimeError, not a wrong result."""
    def body():
        mesh = init_device_mesh("cpu", (4,))
        st.infeasible(distribute_tensor(torch.ones(8), mesh, [S0]))

    with pytest.raises(RuntimeError, match=r"sttest\.infeasible.*S\(0\)"):
        spmd(body)


def test_cost_follows_the_planner_bytes():
    """Selection uses the planner's modeled cost: moving a big input costs more than a small one."""
    from shardtensor.propagation.strategy import input_cost

    def body():
        mesh = init_device_mesh("cpu", (4,))
        small = distribute_tensor(torch.ones(8, 8), mesh, [S0])._spec
        big = distribute_tensor(torch.ones(64, 64), mesh, [S0])._spec
        return (input_cost(small, (R,)), input_cost(big, (R,)), input_cost(big, (S0,)), input_cost(big, (S1,)),
                input_cost(big, (P,)))

    c_small, c_big, c_same, c_a2a, c_inf = spmd(body)[0]
    assert 0 < c_small < c_big
    assert c_same == 0.0
    assert 0 < c_a2a < c_big  # all-to-all moves fewer bytes than all-gather
    assert math.isinf(c_inf)


# -- cache -----------------------------------------------------------------------------------

def test_second_call_is_a_hit_without_metadata_or_rule(monkeypatch):
    """#1 and #23: a hit builds no meta tensors and calls no rule."""
    metas = {"n": 0}
    real = call_module._out_meta

    def counting(*a, **k):
        metas["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(call_module, "_out_meta", counting)
    clear_cache()
    CALLS["pick"] = 0

    def body():
        mesh = init_device_mesh("cpu", (1,))
        x = distribute_tensor(torch.ones(8, 8), mesh, [S0])
        for _ in range(20):
            x = x + 1.0
            x = st.pick(x)
        return x.full_tensor()

    out = spmd(body, 1)
    assert torch.equal(out[0], torch.full((8, 8), 21.0))
    info = cache_info()
    assert info["size"] == 2, info
    assert info["hits"] >= 38, info
    assert CALLS["pick"] == 1
    assert metas["n"] <= 2


def test_int_and_float_scalars_are_different_entries():
    """#2: x.add(1) and x.add(1.0) on int64 give int64 and float32."""
    def body():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.arange(8), mesh, [S0])
        a, b = x.add(1), x.add(1.0)
        return a.dtype, a._local_tensor.dtype, b.dtype, b._local_tensor.dtype, b.full_tensor()

    for da, la, db, lb, full in spmd(body):
        assert da == la == torch.int64
        assert db == lb == torch.float32
        assert torch.equal(full, torch.arange(8) + 1.0)


def test_scalar_values_share_an_entry_but_signs_do_not():
    """x * 2.0 and x * 3.0 share a cache entry (pointwise ops key scalars by type and sign)."""
    clear_cache()

    def body():
        mesh = init_device_mesh("cpu", (1,))
        x = distribute_tensor(torch.arange(8.0), mesh, [S0])
        before = cache_info()["size"]
        y2, y3 = x * 2.0, x * 3.0
        mid = cache_info()["size"]
        yn = x * -1.0
        return before, mid, cache_info()["size"], y2.full_tensor(), y3.full_tensor(), yn.full_tensor()

    before, mid, after, y2, y3, yn = spmd(body, 1)[0]
    assert mid - before == 1 and after - mid == 1
    assert torch.equal(y3, torch.arange(8.0) * 3) and torch.equal(yn, -torch.arange(8.0))


def test_nan_scalar_makes_one_entry():
    """#4: a NaN static arg does not grow the cache."""
    clear_cache()

    def body():
        mesh = init_device_mesh("cpu", (1,))
        x = distribute_tensor(torch.arange(4.0), mesh, [S0])
        for _ in range(1000):
            x.add(float("nan"))
        return cache_info()["size"]

    assert spmd(body, 1)[0] == 1


def test_nested_static_args_freeze():
    """#2/#5 of the pitfalls: nested lists/dicts hash; -0.0/0.0, 1/1.0/True stay distinct."""
    k = _freeze([[1, 2], [3, {"a": [4]}]])
    hash(k)
    assert _freeze(1) != _freeze(1.0) != _freeze(True)
    assert _freeze(float("nan")) == _freeze(float("nan"))
    assert _freeze(torch.ones(3)) == _freeze(torch.zeros(3))  # plain tensors keyed by meta, not identity


def test_decision_depending_on_an_int_argument():
    """#5: a rule whose decision depends on a plain int is right on the second call."""
    def body():
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(torch.ones(4, 4), mesh, [R])
        return st.shardby(x, 0).placements, st.shardby(x, 1).placements

    assert spmd(body, 2)[0] == ((S0,), (S1,))


def test_cache_is_bounded():
    """#21: the LRU evicts; its size never exceeds the bound over many distinct shapes."""
    clear_cache(maxsize=16)
    try:
        def body():
            mesh = init_device_mesh("cpu", (1,))
            peak = 0
            for n in range(1, 200):
                x = distribute_tensor(torch.ones(n), mesh, [S0])
                x + x
                peak = max(peak, cache_info()["size"])
            return peak

        assert spmd(body, 1)[0] <= 16
    finally:
        clear_cache(maxsize=4096)


def test_rank_dependent_sizes_do_not_leak_through_the_cache():
    """#6: new_zeros((7, 5)) on an S(0) tensor of that shape: rank 3 holds (1, 5), the others (2, 5)."""
    def body():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.ones(7, 5), mesh, [S0])
        z = x.new_zeros((7, 5))
        return tuple(z._local_tensor.shape), z.placements

    shapes = spmd(body)
    assert [s for s, _ in shapes] == [(2, 5), (2, 5), (2, 5), (1, 5)]


# -- errors ----------------------------------------------------------------------------------

def test_op_without_rule_names_op_and_placements():
    """Under strict_sharding an op without a rule raises, naming the op and the placements."""
    def body():
        mesh = init_device_mesh("cpu", (4,))
        with strict_sharding():
            st.norule(distribute_tensor(torch.ones(8), mesh, [S0]))

    with pytest.raises(NotImplementedError, match=r"sttest\.norule.*S\(0\)"):
        spmd(body)


def test_the_engine_refuses_a_plain_tensor_where_a_rule_needs_a_dtensor():
    """A rule declares the DTensors it reads (``register(needs=...)``); the engine raises the one
    error, naming the argument, before the rule runs -- and the rule never sees the call."""
    from shardtensor.errors import UnsupportedOpError
    from shardtensor.propagation import propagate
    from shardtensor.propagation.registry import needs_of

    aten = torch.ops.aten
    assert needs_of(aten.gather.default) == ("self", "index")
    assert needs_of(aten.addmm.default) == ("mat1", "mat2", "self")

    def body():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.ones(8, 4), mesh, [S0])
        index = torch.zeros(8, 4, dtype=torch.long)
        flat, treedef = flatten_call((x, 1, index), {})
        with pytest.raises(UnsupportedOpError, match=r"gather.*plain tensor \(or none\) as 'index'.*S\(0\)"):
            propagate(aten.gather.default, flat, [x._spec, None, None], treedef)

    spmd(body)


def test_two_meshes_raise():
    """#19: cross-mesh operations raise RuntimeError."""
    def body():
        m1 = init_device_mesh("cpu", (4,))
        m2 = init_device_mesh("cpu", (2, 2))
        a = distribute_tensor(torch.ones(8), m1, [S0])
        b = distribute_tensor(torch.ones(8), m2, [S0, R])
        a + b

    with pytest.raises(RuntimeError, match="cross-mesh"):
        spmd(body)
    assert issubclass(MeshMismatchError, RuntimeError)


def test_out_tensor_with_other_placements_gets_the_result():
    """#20: an out= DTensor whose placements differ from the result's receives the right value."""
    def body():
        mesh = init_device_mesh("cpu", (4,))
        a = distribute_tensor(torch.arange(8.0), mesh, [S0])
        b = distribute_tensor(torch.ones(8), mesh, [S0])
        out = distribute_tensor(torch.zeros(8), mesh, [R])
        r = torch.add(a, b, out=out)
        return r is out, out.placements, out.full_tensor()

    for same, pl, full in spmd(body):
        assert same and pl == (R,)
        assert torch.equal(full, torch.arange(8.0) + 1)


def test_rule_returning_garbage_is_a_value_error():
    lib_op = "garbage"
    _lib.define(f"{lib_op}(Tensor x) -> Tensor")
    _lib.impl(lib_op, lambda x: x.clone(), "CompositeExplicitAutograd")
    register(getattr(st, lib_op).default)(lambda call: 42)

    def body():
        mesh = init_device_mesh("cpu", (2,))
        st.garbage(distribute_tensor(torch.ones(4), mesh, [S0]))

    with pytest.raises(ValueError, match="returned int"):
        spmd(body, 2)


def test_decide_builds_fresh_output_specs():
    """#8: decisions hold immutable specs; two calls never share a mutable output object."""
    def body():
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(torch.ones(4), mesh, [S0])
        y = x + x
        z = x + x
        return y._spec is z._spec, y._spec == z._spec

    same_obj, equal = spmd(body, 2)[0]
    assert equal  # cached decision reused; DTensorSpec is frozen, so sharing is safe
    with pytest.raises(Exception):
        spmd(lambda: setattr(distribute_tensor(torch.ones(2), init_device_mesh("cpu", (2,)), [S0])._spec,
                             "placements", (R,)), 2)


def test_equal_specs_are_one_object_so_rebuilt_inputs_hit():
    """A spec built again from equal arguments (``from_local`` each step, a redistribute's target)
    is the same object, so the dispatcher's hit path, keyed by spec identity, hits on it."""
    from shardtensor.propagation.engine import HOT_HITS
    from shardtensor.spec import DTensorSpec

    def body():
        mesh = init_device_mesh("cpu", (1,))  # one rank: the hit counter is process-wide
        a = DTensorSpec.build(mesh, [S0], (4, 6), None, torch.float32)
        b = DTensorSpec.build(mesh, (Shard(0),), torch.Size([4, 6]), (6, 1), torch.float32)
        c = DTensorSpec.build(mesh, [S1], (4, 6), None, torch.float32)
        d = a.with_dtype(torch.bfloat16).with_dtype(torch.float32)
        hits = []
        for _ in range(3):
            x = DTensor.from_local(torch.ones(4, 6), mesh, [S0])  # a new DTensor, an equal spec
            before = HOT_HITS.n
            x * 2.0
            hits.append(HOT_HITS.n - before)
        return a is b, a is c, a is d, hits

    for same, other, back, hits in spmd(body, 1):
        assert same and not other and back
        assert hits[1:] == [1, 1], hits  # the first call decides, later ones hit the cached decision


def test_spec_build_still_checks_its_arguments():
    from shardtensor.spec import DTensorSpec

    def body():
        mesh = init_device_mesh("cpu", (2,))
        DTensorSpec.build(mesh, [S0], (4,), None, torch.float32)
        errors = []
        for bad in (lambda: DTensorSpec.build("mesh", [S0], (4,), None, torch.float32),
                    lambda: DTensorSpec.build(mesh, [Shard(3)], (4,), None, torch.float32),
                    lambda: DTensorSpec.build(mesh, [[S0]], (4,), None, torch.float32)):
            try:
                bad()
                errors.append(None)
            except (TypeError, ValueError, IndexError) as e:
                errors.append(type(e).__name__)
        return errors

    assert all(e is not None for e in spmd(body, 2)[0])


def test_size_one_mesh_dims_move_nothing_and_hit():
    """Placements that differ only on mesh dims of one rank hold the same local tensors: such a
    decision runs on the inputs as they are (and is cached for the hit path), and redistributing
    between them returns the local tensor itself."""
    from shardtensor.propagation.engine import HOT_HITS

    def body():
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(3)
        b, x, w = (torch.randn(*s, generator=g) for s in ((5,), (3, 4), (4, 5)))
        db = distribute_tensor(b, mesh, [R])
        dx, dw = distribute_tensor(x, mesh, [S1]), distribute_tensor(w, mesh, [S0])
        outs, hits = [], []
        for _ in range(3):
            before = HOT_HITS.n
            outs.append(torch.addmm(db, dx, dw).full_tensor())
            hits.append(HOT_HITS.n - before)
        p = DTensor.from_local(x.clone(), mesh, [P])
        same = [dx.redistribute(mesh, [R])._local_tensor is dx._local_tensor,
                p.redistribute(mesh, [R])._local_tensor is p._local_tensor]
        return [torch.allclose(o, torch.addmm(b, x, w)) for o in outs], hits, same

    close, hits, same = spmd(body, 1)[0]
    assert all(close) and hits[1:] == [1, 1] and all(same), (close, hits, same)


# -- pointwise output metadata without torch's Python meta references -----------------------

_PW_OPS = [
    (torch.ops.aten.add.Tensor, 2, {}), (torch.ops.aten.mul.Tensor, 2, {}), (torch.ops.aten.div.Tensor, 2, {}),
    (torch.ops.aten.div.Tensor_mode, 2, {"rounding_mode": "floor"}), (torch.ops.aten.eq.Tensor, 2, {}),
    (torch.ops.aten.sigmoid.default, 1, {}), (torch.ops.aten.abs.default, 1, {}), (torch.ops.aten.pow.Tensor_Tensor, 2, {}),
    (torch.ops.aten.bitwise_and.Tensor, 2, {}), (torch.ops.aten.where.self, 3, {}), (torch.ops.aten.add_.Tensor, 2, {}),
    (torch.ops.aten.clamp.Tensor, 3, {}), (torch.ops.aten.angle.default, 1, {}),
]
_PW_DTYPES = [torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.complex64, torch.int8]


@pytest.mark.parametrize("op,n,kw", _PW_OPS, ids=[str(o[0]) for o in _PW_OPS])
def test_pointwise_output_metadata_matches_the_meta_kernels(op, n, kw):
    """``Call.out_meta`` of a pointwise op on inputs of one contiguous shape (computed from
    one-element CPU tensors) has the shape, strides and dtype torch's meta kernels give, for every
    dtype combination, with 0-d tensors and Python scalars mixed in; where the op rejects the
    dtypes, both raise."""
    mesh = init_device_mesh("cpu", (1,))
    shape = (4, 3)
    checked = 0
    for i, dts in enumerate(itertools.product(_PW_DTYPES, repeat=n)):
        if i % 3 and n == 3:  # a third of the 216 triples is plenty
            continue
        metas = [torch.empty(shape, dtype=d, device="meta") for d in dts]
        if n == 2 and i % 4 == 1:  # a dim-ful tensor with a 0-d one / a Python scalar
            metas[1] = torch.empty((), dtype=dts[1], device="meta")
        flat = list(metas)
        specs = [distribute_tensor(torch.zeros(m.shape, dtype=m.dtype), mesh, [Replicate()])._spec for m in metas]
        if n == 2 and i % 4 == 3:
            flat[1], specs[1] = (2.5 if dts[1].is_floating_point else 3), None
        specs = specs + [None] * len(kw)
        fl, treedef = flatten_call(tuple(flat), kw)
        try:
            want = op(*flat, **kw)  # torch's meta kernels
        except Exception:  # noqa: BLE001
            want = None
        got = call_module._pointwise_meta(op, fl, specs, treedef)
        again = call_module._pointwise_meta(op, fl, specs, treedef)  # from the kept small run
        if want is None:
            assert got is None and again is None, (op, dts)
            continue
        if got is None:  # (the fast path declined: nothing to compare)
            continue
        checked += 1
        for g in (got, again):
            assert (tuple(g.shape), g.stride(), g.dtype) == (tuple(want.shape), want.stride(), want.dtype), (op, dts)
    assert checked > 0


_aten = torch.ops.aten
_SHAPED_CALLS = [
    (_aten.sum.default, (), {}), (_aten.sum.default, (), {"dtype": torch.float64}),
    (_aten.sum.dim_IntList, ([1],), {}), (_aten.sum.dim_IntList, ([0, -1], True), {}),
    (_aten.sum.dim_IntList, (None, True), {}), (_aten.sum.dim_IntList, ([1],), {"dtype": torch.int32}),
    (_aten.nansum.default, (), {}), (_aten.mean.default, (), {}), (_aten.mean.dim, ([0],), {}),
    (_aten.mean.dim, ([2], True), {"dtype": torch.float64}), (_aten.prod.default, (), {}),
    (_aten.prod.dim_int, (1, True), {}), (_aten.amax.default, ([1],), {}), (_aten.amin.default, ([0, 2], True), {}),
    (_aten.max.default, (), {}), (_aten.min.default, (), {}), (_aten.any.default, (), {}), (_aten.any.dim, (1,), {}),
    (_aten.any.dims, ([0, 1], True), {}), (_aten.all.default, (), {}), (_aten.all.dim, (2, True), {}),
    (_aten._softmax.default, (-1, False), {}), (_aten._log_softmax.default, (0, False), {}),
    (_aten._safe_softmax.default, (1,), {}),
]


@pytest.mark.parametrize("op,args,kw", _SHAPED_CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(_SHAPED_CALLS)])
def test_shaped_output_metadata_matches_the_meta_kernels(op, args, kw, monkeypatch):
    """``Call.shaped_meta`` (the output shape the rule knows, the dtype from a run on tensors of
    ones) gives the shape, strides and dtype of torch's meta kernels for every dtype; where the
    op rejects the dtype, the meta kernels raise torch's error.  A non-contiguous input takes
    the meta kernels."""
    mesh = init_device_mesh("cpu", (1,))
    fallbacks = []
    real = call_module._out_meta
    monkeypatch.setattr(call_module, "_out_meta", lambda *a: fallbacks.append(a) or real(*a))
    fast = 0
    for dtype in _PW_DTYPES + [torch.uint8, torch.float16, torch.float64]:
        for transposed in (False, True):
            x = torch.zeros((4, 5, 3), dtype=dtype)
            if transposed:
                x = x.transpose(0, 2)
            d = distribute_tensor(x.contiguous(), mesh, [Replicate()])
            spec = d._spec if not transposed else d.transpose(0, 2)._spec
            m = torch.empty_strided(spec.shape, spec.stride, dtype=dtype, device="meta")
            fl, treedef = flatten_call((m, *args), kw)
            specs = [spec] + [None] * (len(fl) - 1)
            try:
                want = op(m, *args, **kw)
            except Exception as e:  # noqa: BLE001
                with pytest.raises(type(e)):
                    Call(op, fl, specs, treedef).shaped_meta(())
                continue
            before = len(fallbacks)
            got = Call(op, fl, specs, treedef).shaped_meta(want.shape)
            again = Call(op, fl, specs, treedef).shaped_meta(want.shape)  # from the kept small run
            for g in (got, again):
                assert (tuple(g.shape), g.stride(), g.dtype) == (tuple(want.shape), want.stride(), want.dtype), \
                    (op, args, kw, dtype, transposed)
            if transposed:  # (contiguous inputs may fall back too: where CPU kernels lack the dtype)
                assert len(fallbacks) > before, (op, dtype)
            fast += len(fallbacks) == before
    assert fast > 0


def test_small_runs_are_kept_per_dtype_rank_and_arguments():
    """A new shape of a seen call (op, dtypes, ranks, other arguments) runs nothing; another
    dtype, rank or argument value runs again."""
    mesh = init_device_mesh("cpu", (1,))
    op = torch.ops.aten.sum.dim_IntList

    def outcome(shape, dtype=torch.float32, dims=(0,), fail=False):
        spec = distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, [Replicate()])._spec
        fl, treedef = flatten_call((spec, list(dims)), {})

        def tiny():
            if fail:
                raise AssertionError("ran again")
            return [torch.ones((1,) * len(shape), dtype=dtype), *dims]
        return call_module._small_run(op, fl, [spec, None], treedef, tiny)

    call_module._RUNS.clear()
    assert outcome((4, 3)) == (torch.float32, 1)
    assert outcome((7, 5), fail=True) == (torch.float32, 1)
    assert outcome((7, 5), torch.int8) == (torch.int64, 1)
    assert outcome((7, 5, 2)) == (torch.float32, 2)
    assert outcome((7, 5), dims=(0, 1)) == (torch.float32, 0)
    with pytest.raises(AssertionError, match="ran again"):
        outcome((7, 5), torch.bfloat16, fail=True)


def test_pointwise_output_metadata_declines_layouts_and_random_ops():
    mesh = init_device_mesh("cpu", (1,))
    x = distribute_tensor(torch.zeros(4, 3), mesh, [Replicate()])
    t = distribute_tensor(torch.zeros(3, 4), mesh, [Replicate()]).t()  # not contiguous
    for op, args in [(torch.ops.aten.clone.default, (x,)), (torch.ops.aten.add.Tensor, (x, t)),
                     (torch.ops.aten.bernoulli.p, (x, 0.5)), (torch.ops.aten.frexp.Tensor, (x,))]:
        fl, treedef = flatten_call(args, {})
        specs = [a._spec if isinstance(a, DTensor) else None for a in fl]
        assert call_module._pointwise_meta(op, fl, specs, treedef) is None, op
