"""Differential tests: foreach ops, fused optimizers, and torch.optim steps on DTensor params."""
from __future__ import annotations

import functools
import random

import pytest
import torch

from opcheck import MESHES, check, data, gen  # noqa: E402

from shardtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh, run_spmd  # noqa: E402


SHAPES = [(7, 3), (3,), (4, 5)]


def sampled(values, mesh, n: int, partial=("sum",), seed=0) -> list[tuple]:
    """``n`` random placement combos, each leaf drawn independently (opcheck enumerates the full
    product first, which explodes for lists on a 2-D mesh); the all-Replicate combo first."""
    leaves = [t for v in values for t in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]
    per = list(partial) if partial and not isinstance(partial[0], str) else [tuple(partial)] * len(leaves)
    rng = random.Random(repr((seed, mesh)))
    combos = [tuple((Replicate(),) * len(mesh) for _ in leaves)]
    for _ in range(n - 1):
        combo = []
        for t, kinds in zip(leaves, per):
            opts = [Replicate()] + [Shard(d) for d in range(t.ndim)] + [Partial(k) for k in kinds]
            combo.append(tuple(rng.choice(opts) for _ in mesh))
        combos.append(tuple(combo))
    return combos


def _lists(kind: str, tag: str, shapes=SHAPES) -> list[torch.Tensor]:
    return [data(kind, s, gen((tag, s))) for s in shapes]


def fcheck(fn, values, mesh, *, limit: int = 8, partial=("sum",), seed=0, combos=None, **kw) -> list:
    """``opcheck.check`` over :func:`sampled` combos."""
    if combos is None:
        combos = sampled(values, mesh, limit, partial, seed)
    return check(fn, values, mesh, combos=combos, seed=seed, **kw)


def _outs_keep(seen, pairs) -> None:
    """For each (input placements, output placements) listed in ``pairs``: where an element's
    input had the first, its output has the second."""
    for ins, outs in seen:
        for i, o in zip(ins, outs):
            for a, b in pairs:
                if i == a:
                    assert o == b, f"{i} -> {o}, expected {b}"


# -- out-of-place ------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES)
def test_foreach_unary(mesh):
    xs = _lists("any", "u")
    pos = _lists("pos", "p")
    seen = fcheck(lambda l: torch._foreach_neg(l), [xs], mesh, partial=("sum",), limit=8)
    k = len(mesh)
    _outs_keep(seen, [((Partial("sum"),) * k, (Partial("sum"),) * k), ((Shard(0),) * k, (Shard(0),) * k)])
    seen = fcheck(lambda l: torch._foreach_sqrt(l), [pos], mesh, partial=("sum",), limit=8)
    for ins, outs in seen:
        assert not any(isinstance(p, Partial) for o in outs for p in o)
    for name in ("reciprocal", "exp", "abs"):
        src = pos if name == "reciprocal" else xs
        fcheck(lambda l: getattr(torch, f"_foreach_{name}")(l), [src], mesh, partial=("max",), limit=4, seed=name)


@pytest.mark.parametrize("mesh", MESHES)
def test_foreach_binary_list(mesh):
    a, b = _lists("any", "a"), _lists("nonzero", "b")
    fcheck(lambda x, y: torch._foreach_add(x, y, alpha=2.0), [a, b], mesh, partial=("sum",), limit=10)
    fcheck(lambda x, y: torch._foreach_sub(x, y), [a, b], mesh, partial=("avg",), limit=8, seed=1)
    seen = fcheck(lambda x, y: torch._foreach_mul(x, y), [a, b], mesh, partial=("sum",), limit=10, seed=2)
    fcheck(lambda x, y: torch._foreach_div(x, y), [a, b], mesh, partial=("sum",), limit=10, seed=3)
    fcheck(lambda x, y: torch._foreach_maximum(x, y), [a, b], mesh, partial=("max",), limit=6, seed=4)
    assert seen


def test_foreach_mul_partial_times_replicate_is_exact():
    a, b = _lists("any", "pr-a"), _lists("any", "pr-b")
    combos = [tuple([(Partial("sum"),)] * 3 + [(Replicate(),)] * 3), tuple([(Replicate(),)] * 3 + [(Partial("sum"),)] * 3),
              tuple([(Partial("sum"),)] * 6), tuple([(Shard(0),)] * 3 + [(Partial("sum"),)] * 3)]
    seen = fcheck(lambda x, y: torch._foreach_mul(x, y), [a, b], (4,), combos=combos)
    assert seen[0][1] == ((Partial("sum"),),) * 3
    assert seen[3][1] == ((Shard(0),),) * 3


@pytest.mark.parametrize("mesh", MESHES)
def test_foreach_scalar_forms(mesh):
    xs = _lists("any", "s")
    k = len(mesh)
    seen = fcheck(lambda l: torch._foreach_mul(l, -2.5), [xs], mesh, partial=("sum",), limit=8)
    _outs_keep(seen, [((Partial("sum"),) * k, (Partial("sum"),) * k)])
    seen = fcheck(lambda l: torch._foreach_add(l, 1.0), [xs], mesh, partial=("sum",), limit=8, seed=1)
    for ins, outs in seen:
        assert not any(isinstance(p, Partial) for o in outs for p in o)
    fcheck(lambda l: torch._foreach_div(l, [2.0, -4.0, 0.5]), [xs], mesh, partial=("avg",), limit=6, seed=2)
    fcheck(lambda l: torch._foreach_sub(l, [1.0, 2.0, 3.0]), [xs], mesh, partial=("sum",), limit=6, seed=3)
    fcheck(lambda l, s: torch._foreach_mul(l, s), [xs, torch.tensor(1.5)], mesh, partial=("sum",), limit=8, seed=4,
          grad=False)
    fcheck(lambda l: torch._foreach_maximum(l, 0.25), [xs], mesh, partial=("max",), limit=6, seed=5)
    fcheck(lambda l: torch._foreach_clamp_min(l, [0.0, 0.5, -0.5]), [xs], mesh, limit=6, seed=6)


@pytest.mark.parametrize("mesh", MESHES)
def test_foreach_addcmul_addcdiv_pow_lerp(mesh):
    s, t1, t2 = _lists("any", "s"), _lists("any", "t1"), _lists("nonzero", "t2")
    fcheck(lambda a, b, c: torch._foreach_addcmul(a, b, c, value=0.5), [s, t1, t2], mesh, partial=("sum",), limit=8)
    fcheck(lambda a, b, c: torch._foreach_addcdiv(a, b, c, [0.5, -1.0, 2.0]), [s, t1, t2], mesh, partial=("sum",),
          limit=8, seed=1)
    pos, e = _lists("pos", "base"), _lists("coarse", "exp")
    fcheck(lambda a, b: torch._foreach_pow(a, b), [pos, e], mesh, partial=("sum",), limit=8, seed=2)
    fcheck(lambda a: torch._foreach_pow(a, 2.0), [s], mesh, partial=("sum",), limit=6, seed=3)
    fcheck(lambda a: torch._foreach_pow(2.0, a), [e], mesh, partial=("sum",), limit=6, seed=4)
    w = [x.abs() / 8 for x in _lists("any", "w")]
    fcheck(lambda a, b: torch._foreach_lerp(a, b, 0.25), [s, t1], mesh, partial=("sum",), limit=8, seed=5)
    fcheck(lambda a, b, c: torch._foreach_lerp(a, b, c), [s, t1, w], mesh, partial=("sum",), limit=8, seed=6)


# -- in-place ----------------------------------------------------------------------------

def _inplace(op, *extra, **kw):
    def fn(xs, *others):
        ys = [x.clone() for x in xs]
        op(ys, *others, *extra, **kw)
        return ys

    return fn


@pytest.mark.parametrize("mesh", MESHES)
def test_foreach_inplace_binary_keeps_self(mesh):
    a, b, c = _lists("any", "ia"), _lists("nonzero", "ib"), _lists("any", "ic")
    for i, (op, kw) in enumerate([(torch._foreach_add_, dict(alpha=-0.5)), (torch._foreach_sub_, {}),
                                  (torch._foreach_mul_, {}), (torch._foreach_div_, {})]):
        seen = fcheck(_inplace(op, **kw), [c, b] if op is torch._foreach_div_ else [a, b], mesh, partial=("sum",),
                     limit=10, seed=i, grad=False)
        for ins, outs in seen:
            assert tuple(outs) == tuple(ins[:3]), f"{op.__name__}: self {ins[:3]} became {outs}"
    seen = fcheck(_inplace(torch._foreach_addcmul_, value=2.0), [a, b, c], mesh, partial=[()] * 3 + [("sum",)] * 6,
                 limit=10, grad=False, seed=9)
    for ins, outs in seen:
        assert tuple(outs) == tuple(ins[:3])
    fcheck(_inplace(torch._foreach_addcdiv_, [1.0, 2.0, 3.0]), [a, c, b], mesh, partial=[()] * 3 + [("sum",)] * 6,
          limit=8, grad=False, seed=10)
    fcheck(_inplace(torch._foreach_lerp_, 0.5), [a, c], mesh, partial=[()] * 3 + [("sum",)] * 3, limit=8, grad=False,
          seed=11)


@pytest.mark.parametrize("mesh", MESHES)
def test_foreach_inplace_unary_scalar_copy_zero(mesh):
    xs, pos = _lists("any", "iu"), _lists("pos", "ip")
    fcheck(_inplace(torch._foreach_neg_), [xs], mesh, partial=("sum",), limit=6, grad=False)
    fcheck(_inplace(torch._foreach_sqrt_), [pos], mesh, partial=(), limit=6, grad=False)
    fcheck(_inplace(torch._foreach_mul_, 3.0), [xs], mesh, partial=("sum",), limit=6, grad=False)
    fcheck(_inplace(torch._foreach_add_, [1.0, 2.0, -3.0]), [xs], mesh, partial=(), limit=6, grad=False)
    fcheck(_inplace(torch._foreach_pow_, 2.0), [xs], mesh, partial=(), limit=4, grad=False)
    fcheck(_inplace(torch._foreach_maximum_), [xs, pos], mesh, partial=[()] * 3 + [("max",)] * 3, limit=6, grad=False)

    def copy(dst, src):
        ys = [x.clone() for x in dst]
        torch._foreach_copy_(ys, src)
        return ys

    seen = fcheck(copy, [xs, pos], mesh, partial=("sum",), limit=10, grad=False)
    for ins, outs in seen:
        assert tuple(outs) == tuple(ins[:3])

    def zero(l):
        ys = [x.clone() for x in l]
        torch._foreach_zero_(ys)
        return ys

    fcheck(zero, [xs], mesh, partial=("sum",), limit=6, grad=False)


def test_foreach_inplace_that_would_move_self_raises():
    def body(op):
        mesh = init_device_mesh("cpu", (4,))
        p = DTensor.from_local(torch.ones(3), mesh, [Partial("sum")])
        with pytest.raises(RuntimeError, match="in-place"):
            op([p])
        return p.full_tensor()

    for op in (torch._foreach_sqrt_, lambda l: torch._foreach_add_(l, 1.0), lambda l: torch._foreach_pow_(l, 2.0)):
        for full in run_spmd(body, 4, op):
            assert torch.equal(full, torch.full((3,), 4.0))


def test_foreach_list_length_mismatch_raises():
    def body():
        mesh = init_device_mesh("cpu", (4,))
        a = distribute_tensor(torch.ones(7), mesh, [Shard(0)])
        with pytest.raises(RuntimeError):
            torch._foreach_add([a, a], [a])
        return True

    assert all(run_spmd(body, 4))


# -- fused kernels -----------------------------------------------------------------------

ADAM = dict(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.01, eps=1e-8, maximize=False)


def _fused_adam_body(pls, gpls, values, amsgrad, w):
    mesh = init_device_mesh("cpu", (2, 2))
    n = len(pls)
    p, g, m, v = [[distribute_tensor(t, mesh, pl) for t, pl in zip(values[k], pls)] for k in range(4)]
    g = [x.redistribute(mesh, pl) for x, pl in zip(g, gpls)]
    mx = [distribute_tensor(t, mesh, pl) for t, pl in zip(values[4], pls)] if amsgrad else []
    steps = [torch.tensor(3.0) for _ in range(n)]
    op = torch.ops.aten._fused_adamw.default if w else torch.ops.aten._fused_adam.default
    outs = op(p, g, m, v, mx, steps, amsgrad=amsgrad, **ADAM)
    return [[(o.placements, o.full_tensor()) for o in lst] for lst in outs]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("w", [False, True])
def test_fused_adam_functional(amsgrad, w):
    shapes = [(7, 3), (3,), (4, 5)]
    values = [[data("any", s, gen((k, s))) if k not in (3, 4) else data("pos", s, gen((k, s))) for s in shapes]
              for k in range(5)]
    pls = [[Shard(0), Replicate()], [Replicate(), Shard(0)], [Shard(1), Shard(0)]]
    gpls = [[Replicate(), Replicate()], [Shard(0), Replicate()], [Replicate(), Shard(1)]]
    op = torch.ops.aten._fused_adamw.default if w else torch.ops.aten._fused_adam.default
    dense = op(*[list(x) for x in values[:4]], values[4] if amsgrad else [], [torch.tensor(3.0)] * 3,
               amsgrad=amsgrad, **ADAM)
    for res in run_spmd(_fused_adam_body, 4, pls, gpls, values, amsgrad, w):
        for k, (lst, dl) in enumerate(zip(res, dense)):
            assert len(lst) == len(dl) == (0 if k == 4 and not amsgrad else 3)
            for (pl, full), d, want in zip(lst, dl, pls):
                assert pl == tuple(want)
                torch.testing.assert_close(full, d, rtol=1e-5, atol=1e-6)


# -- torch.optim on DTensor params -------------------------------------------------------

CONFIGS = {
    "sgd": ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "sgd_nesterov": ("SGD", dict(lr=0.05, momentum=0.8, nesterov=True, dampening=0.0)),
    "adam": ("Adam", dict(lr=0.1, weight_decay=0.01)),
    "adamw": ("AdamW", dict(lr=0.1, weight_decay=0.1, amsgrad=True)),
}
MODES = {"foreach": dict(foreach=True), "fused": dict(fused=True), "single": dict(foreach=False), "default": {}}


def optimizer_steps(name: str, mode: str, params, grads):
    """Three steps of a torch.optim optimizer; returns the params (works on DTensors and tensors)."""
    cls, kw = CONFIGS[name]
    ps = [p.detach().clone() for p in params]
    opt = getattr(torch.optim, cls)(ps, **kw, **MODES[mode])
    for step in range(3):
        for p, g in zip(ps, grads):
            p.grad = g * (1.0 + step)
        opt.step()
    return ps


OPT_SHAPES = [(7, 3), (3,), (4, 7)]


def _opt_values():
    return [[data("any", s, gen(("p", s))) for s in OPT_SHAPES], [data("any", s, gen(("g", s))) for s in OPT_SHAPES]]


@pytest.mark.parametrize("mode", ["foreach", "fused", "default"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mesh", MESHES)
def test_optimizer_mixed_placements_partial_grads(mesh, name, mode):
    n = len(OPT_SHAPES)
    fcheck(functools.partial(optimizer_steps, name, mode), _opt_values(), mesh, grad=False,
          partial=[()] * n + [("sum",)] * n, limit=4, seed=(name, mode))


def _defaults_of_torch_optim():
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.utils._foreach_utils import _has_foreach_support

    x = distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (2,)), [Shard(0)])
    return _default_to_fused_or_foreach([x], False), _has_foreach_support([x], x.device)


def test_optimizers_default_to_foreach_on_dtensors(monkeypatch):
    # torch.optim picks foreach by default only for tensor types on its lists (and on devices with
    # foreach kernels: CUDA, not CPU); ours was missing, so on a GPU every optimizer without
    # foreach=True looped per parameter.  CPU stands in for a foreach device here.
    import torch.optim.optimizer as optimizer

    monkeypatch.setattr(optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    assert run_spmd(_defaults_of_torch_optim, 2) == [((False, True), True)] * 2


@pytest.mark.parametrize("name", list(CONFIGS))
def test_optimizer_single_tensor_grads_like_params(name):
    r, s0, s1 = (Replicate(), Replicate()), (Shard(0), Replicate()), (Replicate(), Shard(1))
    nested = (Shard(0), Shard(0))
    combos = [(s0, r, s1, s0, r, s1), (nested, (Shard(0), Replicate()), r, nested, (Shard(0), Replicate()), r)]
    fcheck(functools.partial(optimizer_steps, name, "single"), _opt_values(), (2, 2), grad=False, combos=combos)


def test_optimizer_single_tensor_partial_grads():
    s0, p = (Shard(0), Replicate()), (Partial("sum"), Partial("sum"))
    combos = [(s0, s0, s0, p, p, p)]
    for name in CONFIGS:
        fcheck(functools.partial(optimizer_steps, name, "single"), _opt_values(), (2, 2), grad=False, combos=combos)


@pytest.mark.parametrize("mode", ["foreach", "fused", "single"])
@pytest.mark.parametrize("name", ["sgd", "adam"])  # (amsgrad's single-tensor step calls maximum(out=): decomposed)
def test_warm_optimizer_steps_take_only_the_hit_path(name, mode, monkeypatch):
    """From the third step on, every op of a step is a cached decision run as unwrap, kernel, wrap
    on its arguments as given: neither the full dispatch path (``run.propagate``), nor a
    decomposition, nor the hit path's flattened form is entered, whatever the op's keyword
    arguments, scalar lists (bias corrections that change every step) or lists of 0-d step
    counters.  The params still equal the dense steps'."""
    import threading

    import shardtensor.dispatch.hit as hit
    import shardtensor.dispatch.run as run

    armed, full = threading.local(), []

    def spy(mod, fname):
        real = getattr(mod, fname)

        def counted(func, *a):
            if getattr(armed, "on", False):
                full.append(f"{fname}: {func}")
            return real(func, *a)

        monkeypatch.setattr(mod, fname, counted)

    spy(run, "propagate"), spy(run, "_decompose"), spy(hit, "_run_flat")
    grads = [[data("any", s, gen(("g", step, s))) for s in OPT_SHAPES] for step in range(4)]
    start = [data("any", s, gen(("p", s))) for s in OPT_SHAPES]

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        pl = [Shard(0), Replicate()]
        ps = [distribute_tensor(t, mesh, pl).requires_grad_() for t in start]
        cls, kw = CONFIGS[name]
        opt = getattr(torch.optim, cls)(ps, **kw, **MODES[mode])
        for step, gs in enumerate(grads):
            for p, g in zip(ps, gs):
                p.grad = distribute_tensor(g, mesh, pl)
            armed.on = step >= 2
            opt.step()
        armed.on = False
        return [p.full_tensor() for p in ps]

    results = run_spmd(body, 4)
    assert full == [], f"warm steps entered the full dispatch path: {sorted(set(full))}"
    ps = [t.clone().requires_grad_() for t in start]
    cls, kw = CONFIGS[name]
    opt = getattr(torch.optim, cls)(ps, **kw, **MODES[mode])
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    for got in results:
        for g, d in zip(got, ps):
            torch.testing.assert_close(g, d.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
def test_optimizer_adam_fused_gloo():
    combos = [((Shard(0),), (Replicate(),), (Shard(1),), (Partial("sum"),), (Shard(0),), (Partial("sum"),))]
    fcheck(functools.partial(optimizer_steps, "adamw", "fused"), _opt_values(), (4,), grad=False, combos=combos,
          world="gloo")


# -- lists over several meshes (torch's 2-D recipe: TP weights on (dp, tp), norm weights on dp) --------

def _two_mesh_params(mesh2):
    """Dense values and DTensors: two on the 2-D mesh, two on mesh['dp'] (a sub-mesh)."""
    dense = [data("any", s, gen(("two-mesh", s))) for s in [(4, 6), (6,), (5, 3), (3,)]]
    pls = [(mesh2, [Shard(0), Shard(1)]), (mesh2["dp"], [Shard(0)]), (mesh2, [Replicate(), Shard(0)]),
           (mesh2["dp"], [Replicate()])]
    return dense, [distribute_tensor(t, m, p) for t, (m, p) in zip(dense, pls)]


def _mesh2():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_foreach_over_two_meshes_keeps_each_mesh():
    def body():
        mesh2 = _mesh2()
        dense, xs = _two_mesh_params(mesh2)
        out = torch._foreach_add(xs, [x * 2 for x in xs])
        norms = torch._foreach_norm(xs)
        torch._foreach_mul_(xs, 3.0)
        coef = distribute_tensor(torch.tensor(0.5), mesh2, [Replicate(), Replicate()])
        torch._foreach_mul_(xs, coef)  # a replicated 0-d on the 2-D mesh joins the dp-mesh tensors too
        return ([o.device_mesh == x.device_mesh and o.placements == x.placements for o, x in zip(out, xs)],
                [o.full_tensor() for o in out], [n.full_tensor() for n in norms], [x.full_tensor() for x in xs],
                dense)

    for same, outs, norms, xs, dense in run_spmd(body, 4):
        assert all(same)
        for o, n, x, t in zip(outs, norms, xs, dense):
            assert torch.equal(o, t * 3)
            torch.testing.assert_close(n, torch.linalg.vector_norm(t))
            assert torch.equal(x, t * 3 * 0.5)


def test_foreach_over_two_meshes_refuses_an_argument_it_cannot_place():
    def body():
        mesh2 = _mesh2()
        _, xs = _two_mesh_params(mesh2)
        coef = distribute_tensor(torch.tensor(0.5), mesh2["dp"], [Replicate()])
        with pytest.raises(RuntimeError, match="cannot join"):
            torch._foreach_mul_(xs, coef)  # dp holds 2 of the 2-D mesh's 4 ranks
        return True

    assert run_spmd(body, 4) == [True] * 4


@pytest.mark.parametrize("mode", ["foreach", "fused"])
def test_adamw_over_two_meshes_matches_one_device(mode):
    def body():
        mesh2 = _mesh2()
        dense, xs = _two_mesh_params(mesh2)
        ref = [torch.nn.Parameter(t.clone()) for t in dense]
        ps = [torch.nn.Parameter(x) for x in xs]
        kw = {mode: True}
        opt, ref_opt = torch.optim.AdamW(ps, lr=0.1, **kw), torch.optim.AdamW(ref, lr=0.1, **kw)
        for step in range(2):
            for p, r in zip(ps, ref):
                g = data("any", r.shape, gen(("grad", step, tuple(r.shape))))
                r.grad = g
                p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            opt.step()
            ref_opt.step()
        return [p.full_tensor() for p in ps], [r.detach() for r in ref]

    for got, want in run_spmd(body, 4):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["foreach", "fused"])
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_optimizer_over_dtensors_and_plain_params(name, mode):
    """A TP model's optimizer holds sharded weights and plain (unsharded) ones in one list: each
    plain parameter steps as a plain tensor on its own rank, even where ranks hold different
    values (they used to be fingerprinted and, where ranks differed, written into rank 0's copy:
    ranks 1.. lost their update), and the sharded ones as one device would."""
    cls, kw = {"sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)), "adam": (torch.optim.Adam, dict(lr=0.1)),
               "adamw": (torch.optim.AdamW, dict(lr=0.1))}[name]

    def body():
        mesh = init_device_mesh("cpu", (2,))
        rank = mesh.get_rank()
        dense = data("any", (5, 3), gen("w"))
        own = [data("any", s, gen(("own", rank, s))) for s in [(4,), (3, 2)]]  # differ per rank
        ps = [torch.nn.Parameter(own[0].clone()), torch.nn.Parameter(distribute_tensor(dense, mesh, [Shard(0)])),
              torch.nn.Parameter(own[1].clone())]
        ref = [torch.nn.Parameter(own[0].clone()), torch.nn.Parameter(dense.clone()),
               torch.nn.Parameter(own[1].clone())]
        opt, ref_opt = cls(ps, **kw, **{mode: True}), cls(ref, **kw, **{mode: True})
        for step in range(3):
            for p, r in zip(ps, ref):
                g = data("any", r.shape, gen(("grad", step, rank if p.ndim != 2 or p.shape != (5, 3) else -1,
                                               tuple(r.shape))))
                r.grad = g
                p.grad = distribute_tensor(g, mesh, [Shard(0)]) if isinstance(p, DTensor) else g.clone()
            opt.step()
            ref_opt.step()
        return ([isinstance(p, DTensor) for p in ps], [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in ps],
                [r.detach() for r in ref])

    for types, got, want in run_spmd(body, 2):
        assert types == [False, True, False]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_foreach_results_over_dtensors_and_plain_tensors_keep_each_kind():
    """An out-of-place foreach op over DTensors and plain tensors: plain in, plain out (it was
    wrapped as a replicated DTensor, so the next foreach op mixed them wrongly)."""
    def body():
        mesh = init_device_mesh("cpu", (2,))
        a = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
        b = torch.full((4,), float(mesh.get_rank() + 1))
        out = torch._foreach_sqrt([a, b])
        torch._foreach_addcdiv_([a, b], out, [x + 1 for x in out], [0.5, 2.0])
        return type(out[0]), type(out[1]), a.full_tensor(), b

    for rank, (t0, t1, a, b) in enumerate(run_spmd(body, 2)):
        assert (t0, t1) == (DTensor, torch.Tensor)
        want_a = torch.arange(6.0).reshape(3, 2)
        s = want_a.sqrt()
        torch.testing.assert_close(a, want_a + 0.5 * s / (s + 1))
        v = torch.tensor(float(rank + 1))
        torch.testing.assert_close(b, torch.full((4,), float(v + 2.0 * v.sqrt() / (v.sqrt() + 1))))


@pytest.mark.parametrize("foreach", [True, False])
def test_clip_grad_norm_over_dtensors_and_plain_grads(foreach):
    """``clip_grad_norm_`` over a sharded and a plain gradient (the same on every rank): the total
    norm and the clipped gradients of one device.  Without foreach, torch's loop scales the plain
    gradient in place by the DTensor coefficient (it raised there, after the DTensor gradient had
    been scaled)."""
    def body():
        mesh = init_device_mesh("cpu", (2,))
        ga, gb = data("any", (4, 3), gen("ga")), data("any", (5,), gen("gb"))
        a = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]))
        b = torch.nn.Parameter(torch.zeros(5))
        a.grad, b.grad = distribute_tensor(ga, mesh, [Shard(0)]), gb.clone()
        total = torch.nn.utils.clip_grad_norm_([a, b], 0.5, foreach=foreach)
        return total.full_tensor(), a.grad.full_tensor(), b.grad, ga, gb

    for total, a, b, ga, gb in run_spmd(body, 2):
        want = torch.linalg.vector_norm(torch.cat([ga.reshape(-1), gb]))
        torch.testing.assert_close(total, want)
        torch.testing.assert_close(a, ga * (0.5 / (want + 1e-6)))
        torch.testing.assert_close(b, gb * (0.5 / (want + 1e-6)))


def test_plain_tensor_written_in_place_by_dtensors():
    """An in-place op on a plain tensor with replicated DTensor arguments runs on plain tensors (the
    DTensors' local values), per rank, and returns the plain tensor; a sharded argument still
    raises, naming the plain tensor, and writes nothing."""
    def body():
        mesh = init_device_mesh("cpu", (2,))
        rank = mesh.get_rank()
        plain = torch.full((3,), float(rank + 1))
        r = distribute_tensor(torch.tensor([1.0, 2.0, 3.0]), mesh, [Replicate()])
        out = plain.mul_(r).add_(r, alpha=2.0)
        s = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
        other = torch.full((4,), float(rank))
        with pytest.raises(RuntimeError, match="plain torch.Tensor of shape"):
            other.add_(s)
        return out is plain, type(out), plain, other

    for rank, (same, kind, plain, other) in enumerate(run_spmd(body, 2)):
        assert same and kind is torch.Tensor
        torch.testing.assert_close(plain, torch.tensor([1.0, 2.0, 3.0]) * (rank + 3))
        torch.testing.assert_close(other, torch.full((4,), float(rank)))
