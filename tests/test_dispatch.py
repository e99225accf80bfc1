"""Differential tests of elementwise dispatch against dense torch, forward and backward.

Every case builds DTensors from global tensors made in the main thread (the simulated
ranks are threads and share torch's global RNG, so nothing random happens inside a rank),
runs the op on the DTensors in ``run_spmd`` and the same op on the dense tensors, and
compares the full result, every rank's local piece, and the gradients of leaf inputs.

Data are dyadic rationals (multiples of 1/64 with small magnitude) and so are the
Partial(sum) terms, so partial sums are exact in float32 whatever the reduction order:
differences from dense torch are library bugs, not rounding.
"""
from __future__ import annotations

import itertools
import math
import random
import re
import zlib
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.nn.functional as F

import shardtensor as st
from shardtensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh, run_spmd

from opcheck import check, close, data, local_piece, make_dtensor, partial_terms, prepare, run_recorded

MESHES = [(4,), (2, 2)]
SHAPES = [(8, 4), (7, 5), (3, 5)]
TIMEOUT = 30.0
RES = 64.0  # data resolution: multiples of 1/RES


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def placement_options(t: torch.Tensor, partial: bool = True) -> list:
    opts = [Replicate()] + [Shard(d) for d in range(t.ndim)]
    if partial and t.dtype != torch.bool:
        opts.append(Partial("sum"))
    return opts


def _seed(*parts: Any) -> int:
    return zlib.crc32(repr(parts).encode())


def placement_combos(tensors: Sequence[torch.Tensor], mesh_shape, limit: int | None, seed: int,
                     partial: Sequence[bool] | None = None) -> list[tuple[tuple, ...]]:
    """All combinations of per-input placements, or ``limit`` of them drawn at random.

    A drawn sample always includes all-Replicate and every input Partial(sum) (where allowed).
    """
    partial = partial or [True] * len(tensors)
    per_input = []
    for t, allow in zip(tensors, partial):
        opts = placement_options(t, allow)
        per_input.append(list(itertools.product(opts, repeat=len(mesh_shape))))
    everything = list(itertools.product(*per_input))
    if limit is None or len(everything) <= limit:
        return everything
    rng = random.Random(seed)
    picked = rng.sample(everything, limit)
    allp = tuple(tuple(Partial("sum") if (a and t.dtype != torch.bool) else Replicate() for _ in mesh_shape)
                 for t, a in zip(tensors, partial))
    allr = tuple(tuple(Replicate() for _ in mesh_shape) for _ in tensors)
    for extra in (allp, allr):
        if extra not in picked:
            picked[-1 if extra is allr else 0] = extra
    return picked


def check_op(fn: Callable, values: Sequence[Any], mesh_shape, *, limit: int | None = 12, grad: bool = True,
             partial: Sequence[bool] | None = None, tol: dict | None = None, grad_tol: dict | None = None,
             combos: list | None = None, linear: bool = False, seed: Any = 0) -> list:
    """``opcheck.check`` over this file's combinations (``partial``: may each tensor input be
    Partial(sum)); ``linear=False`` also asserts that the output is never Partial.

    Returns per-combination ``(input placements, output placements)`` for extra checks.
    """
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if combos is None:
        combos = placement_combos(tensors, mesh_shape, limit, _seed(seed, mesh_shape), partial)
    seen = check(fn, values, mesh_shape, grad=grad, tol=tol, grad_tol=grad_tol, combos=combos, seed=seed)
    if not linear:
        for ins, out_pl in seen:
            assert not any(isinstance(p, Partial) for p in out_pl), \
                f"inputs {ins} -> output {out_pl}: a non-linear op produced a Partial output"
    return seen


def mesh_shape_numel(mesh_shape) -> int:
    n = 1
    for s in mesh_shape:
        n *= s
    return n


def _id(v) -> str:
    return "x".join(map(str, v)) if isinstance(v, tuple) else str(v)


mesh_param = pytest.mark.parametrize("mesh_shape", MESHES, ids=_id)
shape_param = pytest.mark.parametrize("shape", SHAPES, ids=_id)

# ---------------------------------------------------------------------------------------
# unary
# ---------------------------------------------------------------------------------------
UNARY: dict[str, tuple[Callable, str]] = {
    "neg": (torch.neg, "any"),
    "exp": (torch.exp, "any"),
    "relu": (torch.relu, "any"),
    "sigmoid": (torch.sigmoid, "any"),
    "tanh": (torch.tanh, "any"),
    "abs": (torch.abs, "nonzero"),
    "sqrt_abs": (lambda a: torch.sqrt(torch.abs(a)), "nonzero"),
    "gelu": (F.gelu, "any"),
    "gelu_tanh": (lambda a: F.gelu(a, approximate="tanh"), "any"),
    "clone": (torch.clone, "any"),
    "square": (torch.square, "any"),
}
LINEAR_UNARY = {"neg", "clone"}


@pytest.mark.parametrize("op", sorted(UNARY))
@shape_param
@mesh_param
def test_unary(op, shape, mesh_shape):
    fn, kind = UNARY[op]
    x = data(kind, shape, _gen(_seed(op, shape)))
    limit = None if len(mesh_shape) == 1 else 5
    seen = check_op(fn, [x], mesh_shape, limit=limit, linear=op in LINEAR_UNARY, seed=(op, shape))
    for (in_pl,), out_pl in seen:
        if not any(isinstance(p, Partial) for p in in_pl):
            assert out_pl == in_pl, f"{op}: input {in_pl} gave output {out_pl}; elementwise ops keep placements"
        elif op in LINEAR_UNARY:
            assert out_pl == in_pl, f"{op} is linear: {in_pl} should stay, got {out_pl}"
        else:
            assert _reduced(in_pl, out_pl), f"{op}({in_pl}) must reduce the Partial first: got {out_pl}"


def _reduced(in_pl, out_pl) -> bool:
    """Each Partial mesh dim of ``in_pl`` reduced: to Replicate, or reduce-scattered into a Shard
    where another mesh dim already shards (half the bytes of an all-reduce); the rest kept."""
    sharded = [j for j, p in enumerate(in_pl) if isinstance(p, Shard)]
    for j, (a, b) in enumerate(zip(in_pl, out_pl)):
        if isinstance(a, Partial):
            if not (b == Replicate() or isinstance(b, Shard) and any(k != j for k in sharded)):
                return False
        elif a != b:
            return False
    return True


# ---------------------------------------------------------------------------------------
# binary (same shapes)
# ---------------------------------------------------------------------------------------
BINARY: dict[str, tuple[Callable, tuple[str, str], bool]] = {  # fn, data kinds, linear
    "add": (torch.add, ("any", "any"), True),
    "add_alpha": (lambda a, b: torch.add(a, b, alpha=2), ("any", "any"), True),
    "sub": (torch.sub, ("any", "any"), True),
    "mul": (torch.mul, ("any", "any"), True),
    "div": (torch.div, ("any", "nonzero"), True),
    "maximum": (torch.maximum, ("any", "any"), False),
    "minimum": (torch.minimum, ("any", "any"), False),
    "pow": (torch.pow, ("pos", "any"), False),
    "atan2": (torch.atan2, ("any", "nonzero"), False),
}
COMPARE = {
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
}


@pytest.mark.parametrize("op", sorted(BINARY))
@shape_param
@mesh_param
def test_binary(op, shape, mesh_shape):
    fn, kinds, linear = BINARY[op]
    g = _gen(_seed(op, shape))
    x, y = data(kinds[0], shape, g), data(kinds[1], shape, g)
    limit = 12 if len(mesh_shape) == 1 else 8
    seen = check_op(fn, [x, y], mesh_shape, limit=limit, grad=False, linear=linear, seed=(op, shape))
    for (a, b), out_pl in seen:
        if a == b and not any(isinstance(p, Partial) for p in a):
            assert out_pl == a, f"{op}: both inputs {a} gave output {out_pl}"


@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize("shape", [(8, 4), (7, 5)], ids=_id)
@mesh_param
def test_binary_backward(op, shape, mesh_shape):
    fn, kinds, linear = BINARY[op]
    g = _gen(_seed(op, shape, "bwd"))
    x, y = data(kinds[0], shape, g), data(kinds[1], shape, g)
    check_op(fn, [x, y], mesh_shape, limit=4, linear=linear, seed=(op, shape, "bwd"))


@pytest.mark.parametrize("op", sorted(COMPARE))
@mesh_param
def test_comparison(op, mesh_shape):
    fn = COMPARE[op]
    g = _gen(_seed(op))
    x, y = data("coarse", (7, 5), g), data("coarse", (7, 5), g)
    assert bool((x == y).any()), "coarse data must contain ties"
    check_op(fn, [x, y], mesh_shape, limit=12, grad=False, seed=op)
    check_op(lambda a: fn(a, 0.5), [x], mesh_shape, limit=None, grad=False, seed=(op, "scalar"))


@mesh_param
@pytest.mark.parametrize("shape", [(7, 5), (3, 5)], ids=_id)
def test_where(mesh_shape, shape):
    g = _gen(_seed("where", shape))
    c, x, y = data("bool", shape, g), data("any", shape, g), data("any", shape, g)
    check_op(torch.where, [c, x, y], mesh_shape, limit=16, seed=("where", shape))
    check_op(lambda cc, a: torch.where(cc, a, 0.0), [c, x], mesh_shape, limit=12, seed=("where0", shape))


@mesh_param
def test_where_broadcast_condition(mesh_shape):
    g = _gen(_seed("wherebc"))
    c, x, y = data("bool", (5,), g), data("any", (7, 5), g), data("any", (7, 1), g)
    check_op(torch.where, [c, x, y], mesh_shape, limit=16, grad=False, seed="wherebc")


@mesh_param
def test_where_broadcast_condition_backward(mesh_shape):
    """The broadcast operand's gradient needs a reduction over the broadcast dim."""
    g = _gen(_seed("wherebcb"))
    c, x, y = data("bool", (5,), g), data("any", (7, 5), g), data("any", (7, 1), g)
    check_op(torch.where, [c, x, y], mesh_shape, limit=4, seed="wherebcb")


# ---------------------------------------------------------------------------------------
# scalars
# ---------------------------------------------------------------------------------------
SCALAR: dict[str, tuple[Callable, str, bool]] = {  # fn, data kind, linear
    "x*2.0": (lambda a: a * 2.0, "any", True),
    "2.0*x": (lambda a: 2.0 * a, "any", True),
    "x/4": (lambda a: a / 4, "any", True),
    "x+1": (lambda a: a + 1, "any", False),
    "1+x": (lambda a: 1 + a, "any", False),
    "x-0.5": (lambda a: a - 0.5, "any", False),
    "2-x": (lambda a: 2 - a, "any", False),
    "1/x": (lambda a: 1 / a, "nonzero", False),
    "-x": (lambda a: -a, "any", True),
    "x**2": (lambda a: a ** 2, "any", False),
    "2**x": (lambda a: 2 ** a, "any", False),
    "x*0-dim": (lambda a: a * torch.tensor(3.0), "any", True),
}


@pytest.mark.parametrize("op", list(SCALAR))
@mesh_param
@pytest.mark.parametrize("shape", [(8, 4), (7, 5)], ids=_id)
def test_scalar(op, mesh_shape, shape):
    fn, kind, linear = SCALAR[op]
    x = data(kind, shape, _gen(_seed(op, shape)))
    check_op(fn, [x], mesh_shape, limit=None if len(mesh_shape) == 1 else 6, linear=linear, seed=(op, shape))


# ---------------------------------------------------------------------------------------
# broadcasting
# ---------------------------------------------------------------------------------------
BCAST_OPS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum}
BCAST_SHAPES = [(5,), (1, 5), (7, 1)]


@pytest.mark.parametrize("op", sorted(BCAST_OPS))
@pytest.mark.parametrize("other", BCAST_SHAPES, ids=_id)
@mesh_param
def test_broadcast_forward(op, other, mesh_shape):
    fn = BCAST_OPS[op]
    g = _gen(_seed("bc", op, other))
    x = data("any", (7, 5), g)
    y = data("nonzero" if op == "div" else "any", other, g)
    check_op(fn, [x, y], mesh_shape, limit=6, grad=False, linear=op != "maximum", seed=("bc", op, other))
    check_op(fn, [y, x], mesh_shape, limit=6, grad=False, linear=op != "maximum", seed=("bcr", op, other))


@mesh_param
def test_broadcast_both_operands(mesh_shape):
    """(7, 1) op (1, 5) -> (7, 5): each operand broadcasts along a different dim."""
    g = _gen(_seed("bc2"))
    a, b = data("any", (7, 1), g), data("any", (1, 5), g)
    check_op(torch.add, [a, b], mesh_shape, limit=12, grad=False, linear=True, seed="bc2")
    check_op(torch.mul, [a, b], mesh_shape, limit=12, grad=False, linear=True, seed="bc2m")


@pytest.mark.parametrize("other", BCAST_SHAPES, ids=_id)
@mesh_param
def test_broadcast_backward(other, mesh_shape):
    """The gradient of a broadcast operand sums over the broadcast dims."""
    g = _gen(_seed("bcb", other))
    x, y = data("any", (7, 5), g), data("any", other, g)
    check_op(torch.mul, [x, y], mesh_shape, limit=8, linear=True, seed=("bcb", other))


# ---------------------------------------------------------------------------------------
# casts, clamp, masked_fill
# ---------------------------------------------------------------------------------------
@mesh_param
@shape_param
def test_cast_float64(mesh_shape, shape):
    x = data("any", shape, _gen(_seed("f64", shape)))
    seen = check_op(lambda a: a.to(torch.float64), [x], mesh_shape, limit=None, grad=False, linear=True,
                    seed=("f64", shape))
    for (in_pl,), out_pl in seen:
        assert out_pl == in_pl, f".to(float64): {in_pl} -> {out_pl}; a float cast keeps placements"


@mesh_param
@shape_param
def test_cast_bfloat16(mesh_shape, shape):
    x = data("coarse", shape, _gen(_seed("bf16", shape)))  # exact in bf16, terms too
    seen = check_op(lambda a: a.to(torch.bfloat16), [x], mesh_shape, limit=None, grad=False, linear=True,
                    seed=("bf16", shape))
    for (in_pl,), out_pl in seen:
        # rounding does not commute with a sum: round(a + b) != round(a) + round(b), so a
        # Partial(sum|avg) is reduced before the cast; shards and replicas are kept
        if any(isinstance(p, Partial) and p.reduce_op in ("sum", "avg") for p in in_pl):
            assert _reduced(in_pl, out_pl), f".to(bfloat16): {in_pl} -> {out_pl}"
        else:
            assert out_pl == in_pl, f".to(bfloat16): {in_pl} -> {out_pl}"


@mesh_param
def test_cast_float64_backward(mesh_shape):
    """The backward of a dtype cast is a cast back (aten._to_copy with dtype/layout/device kwargs)."""
    x = data("any", (7, 5), _gen(_seed("f64b")))
    check_op(lambda a: a.to(torch.float64), [x], mesh_shape, limit=6, linear=True, seed="f64b")


@mesh_param
def test_cast_bfloat16_roundtrip_backward(mesh_shape):
    x = data("coarse", (7, 5), _gen(_seed("bf16rt")))  # exact in bf16, terms too
    check_op(lambda a: a.to(torch.bfloat16).to(torch.float32) * 2, [x], mesh_shape, limit=None, linear=True,
             seed="bf16rt")


@mesh_param
def test_cast_to_int_reduces_partial(mesh_shape):
    """Truncation is not linear: trunc(sum of terms) != sum of trunc(terms)."""
    x = data("any", (7, 5), _gen(_seed("int"))) * 4
    seen = check_op(lambda a: a.to(torch.int32), [x], mesh_shape, limit=None, grad=False, seed="int")
    for (in_pl,), out_pl in seen:
        assert not any(isinstance(p, Partial) for p in out_pl)


@mesh_param
def test_bool_to_float(mesh_shape):
    m = data("bool", (7, 5), _gen(_seed("b2f")))
    seen = check_op(lambda a: a.float(), [m], mesh_shape, limit=None, grad=False, seed="b2f")
    for (in_pl,), out_pl in seen:
        assert out_pl == in_pl


@mesh_param
@shape_param
def test_clamp(mesh_shape, shape):
    x = data("any", shape, _gen(_seed("clamp", shape)))
    check_op(lambda a: a.clamp(-0.5, 0.75), [x], mesh_shape, limit=8, seed=("clamp", shape))
    check_op(lambda a: torch.clamp(a, min=0.25), [x], mesh_shape, limit=8, seed=("clampmin", shape))


@mesh_param
def test_clamp_tensor_bounds(mesh_shape):
    g = _gen(_seed("clampT"))
    x, lo = data("any", (7, 5), g), data("any", (7, 5), g)
    hi = lo + 0.5
    check_op(lambda a, b, c: torch.clamp(a, min=b, max=c), [x, lo, hi], mesh_shape, limit=12, seed="clampT")


@mesh_param
@pytest.mark.parametrize("mask_shape", [(7, 5), (5,)], ids=_id)
def test_masked_fill(mesh_shape, mask_shape):
    assert torch.Tag.pointwise in torch.ops.aten.masked_fill.Scalar.tags
    g = _gen(_seed("mf", mask_shape))
    x, m = data("any", (7, 5), g), data("bool", mask_shape, g)
    check_op(lambda a, mm: a.masked_fill(mm, -1.5), [x, m], mesh_shape, limit=16, seed=("mf", mask_shape))


# ---------------------------------------------------------------------------------------
# other Partial kinds
# ---------------------------------------------------------------------------------------
def _kind_combos(mesh_shape, kind: str, n_inputs: int, others=(Replicate(), Shard(0))):
    """Placements with ``Partial(kind)`` on at least one mesh dim of every input."""
    per = [pl for pl in itertools.product([Partial(kind), *others], repeat=len(mesh_shape))
           if Partial(kind) in pl]
    return list(itertools.product(per, repeat=n_inputs))


@pytest.mark.parametrize("kind", ["avg", "max"])
@mesh_param
def test_other_partial_kinds(kind, mesh_shape):
    g = _gen(_seed("kinds", kind))
    x, y = data("any", (7, 5), g), data("any", (7, 5), g)
    lin = kind == "avg"
    # Partial outputs are allowed where the op commutes with the reduction: linear ops for avg;
    # monotone ones for max (rules/pointwise.py's ORDER_ROWS: neg swaps max and min)
    keeps = {"clone"} | ({"neg", "exp", "x+1", "relu", "add", "sub", "maximum"} if kind == "max" else set())
    for name, fn in [("neg", torch.neg), ("exp", torch.exp), ("x*2", lambda a: a * 2.0), ("x+1", lambda a: a + 1),
                     ("clone", torch.clone), ("relu", torch.relu)]:
        check_op(fn, [x], mesh_shape, combos=_kind_combos(mesh_shape, kind, 1), linear=lin or name in keeps,
                 seed=("kinds", kind, name))
    for name, fn in [("add", torch.add), ("mul", torch.mul), ("sub", torch.sub), ("maximum", torch.maximum)]:
        check_op(fn, [x, y], mesh_shape, combos=_kind_combos(mesh_shape, kind, 2)[:12], grad=False,
                 linear=lin or name in keeps, seed=("kinds2", kind, name))


# ---------------------------------------------------------------------------------------
# placements the issue defines
# ---------------------------------------------------------------------------------------
def _placements_of(fn, values, placements, mesh_shape=(4,)):
    """(output placements, full value, dense value) for one explicit combination."""
    g = _gen(_seed("explicit", repr(placements)))
    case = prepare(values, placements, mesh_shape, g)

    def body():
        mesh = init_device_mesh("cpu", mesh_shape)
        args = [make_dtensor(p, mesh, False) if p.placements is not None else p.value for p in case]
        out = fn(*args)
        return tuple(out.placements), out.full_tensor()

    res = run_spmd(body, mesh_shape_numel(mesh_shape), timeout=TIMEOUT)
    dense = fn(*values)
    for pl, full in res:
        close(full, dense, f"{placements}", None)
    return res[0][0]


P, R, S0, S1 = Partial("sum"), Replicate(), Shard(0), Shard(1)
_X = data("any", (7, 5), _gen(1))
_Y = data("nonzero", (7, 5), _gen(2))

EXPECTED = [  # (name, fn, values, input placements, predicate on output placements, description)
    ("P+P", torch.add, [_X, _Y], [(P,), (P,)], lambda o: o == (P,), "stays Partial(sum)"),
    ("P-P", torch.sub, [_X, _Y], [(P,), (P,)], lambda o: o == (P,), "stays Partial(sum)"),
    ("P*2.0", lambda a: a * 2.0, [_X], [(P,)], lambda o: o == (P,), "stays Partial(sum)"),
    ("2.0*P", lambda a: 2.0 * a, [_X], [(P,)], lambda o: o == (P,), "stays Partial(sum)"),
    ("P/2", lambda a: a / 2, [_X], [(P,)], lambda o: o == (P,), "stays Partial(sum)"),
    ("-P", torch.neg, [_X], [(P,)], lambda o: o == (P,), "stays Partial(sum)"),
    ("P*R", torch.mul, [_X, _Y], [(P,), (R,)], lambda o: o == (P,), "stays Partial(sum)"),
    ("R*P", torch.mul, [_X, _Y], [(R,), (P,)], lambda o: o == (P,), "stays Partial(sum)"),
    ("P/R", torch.div, [_X, _Y], [(P,), (R,)], lambda o: o == (P,), "stays Partial(sum)"),
    ("R/P", torch.div, [_Y, _Y], [(R,), (P,)], lambda o: P not in o, "is reduced (1/x is not linear)"),
    ("P*P", torch.mul, [_X, _Y], [(P,), (P,)], lambda o: o == (P,), "stays Partial (one factor reduced)"),
    ("P+1", lambda a: a + 1, [_X], [(P,)], lambda o: P not in o, "is NOT Partial(sum)"),
    ("1+P", lambda a: 1 + a, [_X], [(P,)], lambda o: P not in o, "is NOT Partial(sum)"),
    ("P-0.5", lambda a: a - 0.5, [_X], [(P,)], lambda o: P not in o, "is NOT Partial(sum)"),
    ("2-P", lambda a: 2 - a, [_X], [(P,)], lambda o: P not in o, "is NOT Partial(sum)"),
    ("relu(P)", torch.relu, [_X], [(P,)], lambda o: o == (R,), "is reduced first"),
    ("exp(P)", torch.exp, [_X], [(P,)], lambda o: o == (R,), "is reduced first"),
    ("P>0", lambda a: a > 0, [_X], [(P,)], lambda o: o == (R,), "is reduced first"),
    ("maximum(P,R)", torch.maximum, [_X, _Y], [(P,), (R,)], lambda o: o == (R,), "is reduced first"),
    ("P.to(f64)", lambda a: a.to(torch.float64), [_X], [(P,)], lambda o: o == (P,), "stays Partial"),
    ("ones_like(P)", torch.ones_like, [_X], [(P,)], lambda o: P not in o, "must NOT be Partial"),
    ("full_like(P)", lambda a: torch.full_like(a, 3.0), [_X], [(P,)], lambda o: P not in o, "must NOT be Partial"),
    ("S0+R", torch.add, [_X, _Y], [(S0,), (R,)], lambda o: o == (S0,), "keeps Shard(0)"),
    ("R*S1", torch.mul, [_X, _Y], [(R,), (S1,)], lambda o: o == (S1,), "keeps Shard(1)"),
    ("S1+S1", torch.add, [_X, _Y], [(S1,), (S1,)], lambda o: o == (S1,), "keeps Shard(1)"),
    ("exp(S0)", torch.exp, [_X], [(S0,)], lambda o: o == (S0,), "keeps Shard(0)"),
    ("P+S0", torch.add, [_X, _Y], [(P,), (S0,)], lambda o: o == (S0,), "is Shard(0)"),
]


@pytest.mark.parametrize("name,fn,values,placements,pred,desc", EXPECTED, ids=[e[0] for e in EXPECTED])
def test_result_placements_1d(name, fn, values, placements, pred, desc):
    out = _placements_of(fn, values, placements)
    assert pred(out), f"{name}: result {desc}; got {out}"


EXPECTED_2D = [
    ("[S0,P]+[R,P]", torch.add, [_X, _Y], [(S0, P), (R, P)], (S0, P)),
    ("[P,P]+[P,P]", torch.add, [_X, _Y], [(P, P), (P, P)], (P, P)),
    ("[P,R]*[R,P]", torch.mul, [_X, _Y], [(P, R), (R, P)], (P, P)),
    ("[P,S1]*2", lambda a: a * 2.0, [_X], [(P, S1)], (P, S1)),
    ("relu[P,S1]", torch.relu, [_X], [(P, S1)], (S0, S1)),  # reduce-scatter, not all-reduce
    ("[S0,S1]+[S0,S1]", torch.add, [_X, _Y], [(S0, S1), (S0, S1)], (S0, S1)),
    ("[S0,S0]+[S0,S0]", torch.add, [_X, _Y], [(S0, S0), (S0, S0)], (S0, S0)),
    ("[P,S0]+1", lambda a: a + 1, [_X], [(P, S0)], (S1, S0)),
    ("ones_like[P,S0]", torch.ones_like, [_X], [(P, S0)], (R, S0)),
    ("zeros_like[P,S0]", torch.zeros_like, [_X], [(P, S0)], None),
]


@pytest.mark.parametrize("name,fn,values,placements,expect", EXPECTED_2D, ids=[e[0] for e in EXPECTED_2D])
def test_result_placements_2d(name, fn, values, placements, expect):
    out = _placements_of(fn, values, placements, (2, 2))
    if expect is not None:
        assert out == expect, f"{name}: expected {expect}, got {out}"


def test_broadcast_result_placements():
    x, v = _X, data("any", (5,), _gen(3))
    assert _placements_of(torch.add, [x, v], [(S1,), (R,)]) == (S1,)
    assert _placements_of(torch.add, [x, v], [(R,), (S0,)]) == (S1,), "(5,) Shard(0) maps to output dim 1"
    assert _placements_of(torch.mul, [v, x], [(S0,), (S0,)]) in ((S0,), (S1,)), "one operand's shard is kept"
    assert _placements_of(torch.add, [x, v], [(P,), (R,)]) == (P,), "P + broadcast R stays P (linear)"


# ---------------------------------------------------------------------------------------
# *_like
# ---------------------------------------------------------------------------------------
LIKE = {
    "zeros_like": (torch.zeros_like, True),
    "ones_like": (torch.ones_like, False),
    "full_like": (lambda a: torch.full_like(a, 2.5), False),
    "zeros_like_f64": (lambda a: torch.zeros_like(a, dtype=torch.float64), True),
}


@pytest.mark.parametrize("op", sorted(LIKE))
@mesh_param
@shape_param
def test_like(op, mesh_shape, shape):
    fn, may_partial = LIKE[op]
    x = data("any", shape, _gen(_seed("like", shape)))
    seen = check_op(fn, [x], mesh_shape, limit=None, grad=False, linear=may_partial, seed=("like", op, shape))
    for (in_pl,), out_pl in seen:
        expect = tuple(Replicate() if isinstance(p, Partial) and not may_partial else p for p in in_pl)
        assert out_pl == expect, f"{op}({in_pl}) -> {out_pl}, expected {expect}"


# ---------------------------------------------------------------------------------------
# in-place
# ---------------------------------------------------------------------------------------
INPLACE = {
    "add_": (lambda a, b: a.add_(b), 2),
    "sub_": (lambda a, b: a.sub_(b), 2),
    "mul_T": (lambda a, b: a.mul_(b), 2),
    "mul_2": (lambda a: a.mul_(2), 1),
    "div_2": (lambda a: a.div_(2), 1),
    "add_1": (lambda a: a.add_(1), 1),
    "relu_": (lambda a: a.relu_(), 1),
    "clamp_": (lambda a: a.clamp_(-0.5, 0.5), 1),
}


def _inplace_allowed(op: str, pls: tuple) -> bool:
    """Combinations where the in-place op can keep ``self``'s placements (others must raise)."""
    self_pl = pls[0]
    if op in ("mul_2", "div_2"):
        return True
    if op in ("add_1", "relu_", "clamp_"):
        return P not in self_pl
    for a, b in zip(self_pl, pls[1]):
        if isinstance(a, Shard):
            continue  # self's shard wins; other follows
        if isinstance(b, Shard):
            return False  # self would have to become sharded
        if a == P:
            if b == P and op == "mul_T":
                return False  # product of sums: self must be reduced
        elif b == P:
            return False  # self (Replicate) cannot take a Partial operand in place
    return True


@pytest.mark.parametrize("op", sorted(INPLACE))
@mesh_param
def test_inplace(op, mesh_shape):
    fn, n = INPLACE[op]
    g = _gen(_seed("inplace", op))
    vals = [data("any", (7, 5), g) for _ in range(n)]
    combos = placement_combos(vals, mesh_shape, 24, _seed("ip", op, mesh_shape))
    ok = [c for c in combos if _inplace_allowed(op, c)]
    assert ok
    seen = check_op(lambda *a: _same_object(fn, *a), vals, mesh_shape, combos=ok, grad=False, linear=True,
                    seed=("inplace", op))
    for pls, out_pl in seen:
        assert out_pl == pls[0], f"{op}: self {pls[0]} became {out_pl}; in-place ops keep placements"


def _same_object(fn, *args):
    out = fn(*args)
    assert out is args[0], "an in-place op must return its self argument"
    return out


@mesh_param
def test_inplace_keeps_self_placements_and_moves_the_other_operand(mesh_shape):
    """x (Replicate) += y (Shard) and x (Shard) += y (Partial): self keeps its placements."""
    x, y = _X, _Y
    nd = len(mesh_shape)

    def body():
        mesh = init_device_mesh("cpu", mesh_shape)
        a = distribute_tensor(x, mesh, [R] * nd)
        b = distribute_tensor(y, mesh, [S0] * nd)
        a.add_(b)
        c = distribute_tensor(x, mesh, [S0] * nd)
        d = DTensor.from_local(y / mesh_shape_numel(mesh_shape), mesh, [Partial()] * nd, shape=y.shape)
        c.mul_(2).add_(d)
        return a.placements, a.full_tensor(), c.placements, c.full_tensor()

    for pa, fa, pc, fc in run_spmd(body, mesh_shape_numel(mesh_shape), timeout=TIMEOUT):
        assert pa == (R,) * nd and pc == (S0,) * nd
        close(fa, x + y, "R += S", None)
        close(fc, 2 * x + y, "S += P", None)


@mesh_param
def test_inplace_on_partial_self_that_does_not_commute_reduces_self(mesh_shape):
    """P(sum) self: mul_ by a tensor keeps P(sum); add_(scalar) and exp_ reduce self first (value right)."""
    nd = len(mesh_shape)
    k = mesh_shape_numel(mesh_shape)

    def body():
        mesh = init_device_mesh("cpu", mesh_shape)
        a = DTensor.from_local(_X / k, mesh, [Partial()] * nd, shape=_X.shape)
        b = distribute_tensor(_Y, mesh, [R] * nd)
        r1 = a.mul_(b)
        p1 = a.placements
        a.add_(1.0)
        p2 = a.placements
        a.exp_()
        return r1 is a, p1, p2, a.placements, a.full_tensor()

    for same, p1, p2, p3, full in run_spmd(body, k, timeout=TIMEOUT):
        assert same
        assert p1 == (Partial(),) * nd and p2 == (R,) * nd and p3 == (R,) * nd
        close(full, torch.exp(_X * _Y + 1.0), "value", None)


def test_inplace_in_autograd_graph():
    x, y = _X, _Y

    def body(w):
        mesh = init_device_mesh("cpu", (4,))
        a = distribute_tensor(x, mesh, [S0]).requires_grad_()
        b = distribute_tensor(y, mesh, [S0]).requires_grad_()
        h = a * b
        h.mul_(2)
        h.add_(b)
        (h.full_tensor() * w).sum().backward()
        return a.grad.full_tensor(), b.grad.full_tensor()

    w = data("any", (7, 5), _gen(9))
    xa, yb = x.clone().requires_grad_(), y.clone().requires_grad_()
    h = xa * yb
    h.mul_(2)
    h.add_(yb)
    (h * w).sum().backward()
    for ga, gb in run_spmd(body, 4, w, timeout=TIMEOUT):
        close(ga, xa.grad, "grad a", None)
        close(gb, yb.grad, "grad b", None)


# ---------------------------------------------------------------------------------------
# a composite expression (many dispatches, mixed placements, autograd through all)
# ---------------------------------------------------------------------------------------
@mesh_param
@pytest.mark.parametrize("shape", [(7, 5), (3, 5)], ids=_id)
def test_composite_expression(mesh_shape, shape):
    g = _gen(_seed("composite", shape))
    x, y, z = data("any", shape, g), data("nonzero", shape, g), data("any", shape, g)

    def fn(a, b, c):
        h = torch.tanh(a * 2.0 + b) * c - torch.sigmoid(c) / b
        return torch.where(h > 0, F.gelu(h), h * 0.5).clamp(-1.0, 1.0)

    check_op(fn, [x, y, z], mesh_shape, limit=6, seed=("composite", shape))


# ---------------------------------------------------------------------------------------
# more elementwise ops (forward): every one is elementwise, so each must work
# ---------------------------------------------------------------------------------------
MORE: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "floor_divide": (lambda a, b: a // b, ("any", "nonzero")),
    "remainder": (lambda a, b: a % b, ("any", "nonzero")),
    "fmod": (torch.fmod, ("any", "nonzero")),
    "div_floor": (lambda a, b: torch.div(a, b, rounding_mode="floor"), ("any", "nonzero")),
    "rsub_tensor": (torch.rsub, ("any", "any")),
    "lerp": (lambda a, b: torch.lerp(a, b, 0.25), ("any", "any")),
    "addcmul": (lambda a, b: torch.addcmul(a, a, b, value=0.5), ("any", "any")),
    "hypot": (torch.hypot, ("any", "any")),
    "silu": (F.silu, ("any",)),
    "softplus": (F.softplus, ("any",)),
    "leaky_relu": (lambda a: F.leaky_relu(a, 0.125), ("any",)),
    "hardtanh": (F.hardtanh, ("any",)),
    "hardswish": (F.hardswish, ("any",)),
    "elu": (F.elu, ("any",)),
    "erf": (torch.erf, ("any",)),
    "floor": (torch.floor, ("any",)),
    "sign": (torch.sign, ("any",)),
    "nan_to_num": (torch.nan_to_num, ("any",)),
    "masked_fill_tensor_value": (lambda a: a.masked_fill(a > 0, torch.tensor(0.5)), ("any",)),
    "masked_fill_": (lambda a: _unpartial(a).clone().masked_fill_(a > 0, 0.5), ("any",)),
    "fill_": (lambda a: _unpartial(a).clone().fill_(1.5), ("any",)),
    "zero_": (lambda a: a.clone().zero_(), ("any",)),
    "copy_": (lambda a, b: a.clone().copy_(b), ("any", "any")),
    "type_as": (lambda a, b: a.type_as(b), ("any", "f64")),
    "to_device_dtype": (lambda a: a.to("cpu", torch.float64), ("any",)),
    "relu_then_exp_": (lambda a: torch.relu(a).exp_(), ("any",)),
}


def _unpartial(a):
    """In-place ops cannot change self's placements: reduce Partial operands first."""
    if not isinstance(a, DTensor):
        return a
    pl = [Replicate() if p.is_partial() else p for p in a.placements]
    return a.redistribute(a.device_mesh, pl) if list(a.placements) != pl else a


@mesh_param
def test_inplace_fill_on_partial_becomes_replicate(mesh_shape):
    """fill_ / masked_fill_ on a Partial tensor: self turns Replicate and holds the right value."""
    nd = len(mesh_shape)

    def body():
        mesh = init_device_mesh("cpu", mesh_shape)
        p = DTensor.from_local(torch.ones(7, 5), mesh, [Partial()] * nd, shape=(7, 5))
        a = p.clone().fill_(1.5)
        m = torch.zeros(7, 5, dtype=torch.bool)
        m[::2] = True
        b = p.clone().masked_fill_(distribute_tensor(m, mesh, [R] * nd), 0.5)
        return a.placements, a.full_tensor(), b.placements, b.full_tensor()

    for pa, fa, pb, fb in run_spmd(body, 4, timeout=TIMEOUT):
        assert pa == (R,) * nd and pb == (R,) * nd
        assert torch.equal(fa, torch.full((7, 5), 1.5))
        expect = torch.full((7, 5), 4.0)
        expect[::2] = 0.5
        assert torch.equal(fb, expect)


@pytest.mark.parametrize("op", list(MORE))
@mesh_param
def test_more_elementwise_ops(op, mesh_shape):
    fn, kinds = MORE[op]
    g = _gen(_seed("more", op))
    vals = [data(k, (7, 5), g) if k != "f64" else data("any", (7, 5), g).double() for k in kinds]
    check_op(fn, vals, mesh_shape, limit=8, grad=False, linear=op in ("rsub_tensor", "copy_", "zero_", "type_as",
                                                                        "to_device_dtype", "lerp"),
             seed=("more", op))


def test_multi_output_pointwise_op_dtypes():
    """torch.frexp returns (float mantissa, int32 exponent): each output DTensor has its own dtype."""
    x = _X

    def body():
        mesh = init_device_mesh("cpu", (4,))
        m, e = torch.frexp(distribute_tensor(x, mesh, [S0]))
        return m.dtype, e.dtype, e.to_local().dtype, e.full_tensor(), m.full_tensor()

    dm, de = torch.frexp(x)
    for mdt, edt, elocal, efull, mfull in run_spmd(body, 4, timeout=TIMEOUT):
        assert mdt == dm.dtype
        assert elocal == de.dtype
        assert edt == de.dtype, f"exponent DTensor reports dtype {edt} but holds {elocal} (dense: {de.dtype})"
        assert torch.equal(efull, de) and torch.equal(mfull, dm)


@mesh_param
def test_inplace_mul_of_replicate_self_by_partial(mesh_shape):
    """x (Replicate).mul_(y (Partial)): x cannot stay Replicate with per-rank terms in it.

    Either the op raises (like x.add_(y) does) or the value is right; never silently wrong.
    """
    nd = len(mesh_shape)
    case = prepare([_X, _Y], [(R,) * nd, (P,) + (R,) * (nd - 1)], mesh_shape, _gen(5))

    def body():
        mesh = init_device_mesh("cpu", mesh_shape)
        a, b = (make_dtensor(p, mesh, False) for p in case)
        a.mul_(b)
        return tuple(a.placements), a.full_tensor(), a.to_local().clone()

    try:
        res = run_spmd(body, mesh_shape_numel(mesh_shape), timeout=TIMEOUT)
    except (RuntimeError, NotImplementedError):
        return
    for pl, full, local in res:
        close(full, _X * _Y, f"R.mul_(P) -> {pl}: full_tensor", None)
        if pl == (R,) * nd:
            close(local, _X * _Y, "R.mul_(P) claims Replicate: local", None)


@mesh_param
def test_integer_partial(mesh_shape):
    xi = data("int", (7, 5), _gen(11))
    yi = data("int", (7, 5), _gen(12))
    check_op(torch.add, [xi, yi], mesh_shape, limit=12, grad=False, linear=True, seed="intadd")
    check_op(lambda a: a * 3, [xi], mesh_shape, limit=8, grad=False, linear=True, seed="intmul")
    check_op(lambda a: a.to(torch.float32), [xi], mesh_shape, limit=8, grad=False, linear=True, seed="int2f")
    check_op(lambda a: torch.abs(a), [xi], mesh_shape, limit=8, grad=False, seed="intabs")


@mesh_param
def test_dtype_promotion(mesh_shape):
    g = _gen(_seed("promo"))
    x32, y64 = data("any", (7, 5), g), data("any", (7, 5), g).double()
    xi = data("int", (7, 5), g)
    check_op(torch.add, [x32, y64], mesh_shape, limit=10, grad=False, linear=True, seed="promo1")
    check_op(torch.mul, [x32, y64], mesh_shape, limit=6, linear=True, seed="promo1b")
    check_op(torch.mul, [xi, x32], mesh_shape, limit=10, grad=False, linear=True, seed="promo2")
    check_op(lambda a: a * 0.5, [xi], mesh_shape, limit=8, grad=False, linear=True, seed="promo3")


@mesh_param
def test_zero_dim_dtensor_operand(mesh_shape):
    """A 0-d DTensor (Replicate or Partial) broadcasts against sharded operands."""
    s = torch.tensor(0.75)
    g = _gen(_seed("zerodim"))
    x = data("any", (7, 5), g)
    nd = len(mesh_shape)
    zero_pl = [(R,) * nd, (P,) * nd]
    x_pl = list(itertools.product([R, S0, S1, P], repeat=nd))
    combos = [(a, b) for a in zero_pl for b in x_pl][:24]
    check_op(torch.mul, [s, x], mesh_shape, combos=combos, grad=False, linear=True, seed="zd1")
    check_op(torch.add, [s, x], mesh_shape, combos=combos, grad=False, linear=True, seed="zd2")
    check_op(lambda a: a + 1, [s], mesh_shape, combos=[(p,) for p in zero_pl], seed="zd3")


def test_operands_with_different_shard_orders():
    """[S(0), S(0)] operands split in different mesh-dim orders still combine correctly."""
    x, y = _X, _Y

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        a = distribute_tensor(x, mesh, [S0, S0])
        b = distribute_tensor(y, mesh, [S0, S0]).redistribute(mesh, [S0, S0], shard_order={0: [1, 0]})
        outs = [a + b, b + a, b * 2, torch.exp(b)]
        return [(o.shard_order, o.full_tensor()) for o in outs], b.shard_order

    for outs, border in run_spmd(body, 4, timeout=TIMEOUT):
        assert border == ((0, (1, 0)),)
        for (order, full), dense in zip(outs, [x + y, x + y, y * 2, torch.exp(y)]):
            close(full, dense, f"shard order {order}", None)
        assert outs[2][0] == ((0, (1, 0)),), "a unary op keeps its input's shard order"


# ---------------------------------------------------------------------------------------
# ops that are not elementwise must refuse clearly
# ---------------------------------------------------------------------------------------
NOT_POINTWISE = [  # ops without a sharding rule: under strict_sharding the error names op and placements
    ("pinv", lambda a: torch.linalg.pinv(a), r"pinv", ((7, 5),)),
    ("lstsq", lambda a, b: torch.linalg.lstsq(a, b).solution, r"lstsq", ((7, 5), (7, 3))),
]


@pytest.mark.parametrize("name,fn,pattern,shapes", NOT_POINTWISE, ids=[n[0] for n in NOT_POINTWISE])
@pytest.mark.parametrize("placement", [S0, R, P], ids=str)
def test_not_pointwise_raises_when_strict(name, fn, pattern, shapes, placement):
    vals = [data("any", s, _gen(i)) for i, s in enumerate(shapes)]
    case = prepare(vals, [(placement,)] * len(vals), (4,), _gen(0))

    def body():
        mesh = init_device_mesh("cpu", (4,))
        with st.strict_sharding():
            return fn(*[make_dtensor(p, mesh, False) for p in case]).full_tensor()

    with pytest.raises(NotImplementedError) as ei:
        run_spmd(body, 4, timeout=TIMEOUT)
    msg = str(ei.value)
    assert re.search(r"aten\.", msg) and re.search(pattern, msg), f"message does not name the op: {msg}"
    assert str(placement) in msg, f"message does not name the input placements ({placement}): {msg}"
    assert "[rank " in msg


def test_not_pointwise_2d_names_all_placements():
    case = prepare([_X, data("any", (3, 7), _gen(4))], [(S0, P), (R, S1)], (2, 2), _gen(0))

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        a, b = (make_dtensor(p, mesh, False) for p in case)
        with st.strict_sharding():
            torch.linalg.lstsq(a, b.t())

    with pytest.raises(NotImplementedError) as ei:
        run_spmd(body, 4, timeout=TIMEOUT)
    msg = str(ei.value)
    assert "lstsq" in msg and "(S(0), P(sum))" in msg and "(R, S(0))" in msg, msg


# ---------------------------------------------------------------------------------------
# self-checks of the harness (so a broken helper cannot make every test pass)
# ---------------------------------------------------------------------------------------
def test_harness_local_piece_chunk_rule():
    t = torch.arange(5)
    pieces = [local_piece(t, (4,), (r,), (S0,)).tolist() for r in range(4)]
    assert pieces == [[0, 1], [2, 3], [4], []]
    t = torch.arange(3)
    assert [local_piece(t, (4,), (r,), (S0,)).tolist() for r in range(4)] == [[0], [1], [2], []]


def test_harness_partial_terms_sum_exactly():
    x = data("any", (7, 5), _gen(0))
    terms = partial_terms(x, (2, 2), (P, P), _gen(1))
    assert len(terms) == 4
    assert torch.equal(sum(terms.values()), x)
    assert not any(torch.equal(t, x) for t in terms.values())
    x64 = x.double()
    assert all(t.dtype == torch.float64 for t in partial_terms(x64, (4,), (P,), _gen(2)).values())


@pytest.mark.parametrize("mesh_shape,self_pl,other_pl", [
    ((4,), (P,), (S0,)), ((2, 2), (S0, P), (S0, S1)), ((2, 2), (P, R), (S1, R))])
def test_inplace_add_of_a_shard_into_a_partial(mesh_shape, self_pl, other_pl):
    """A shard cannot become a term of the Partial: self is reduced there first (it raised
    'redistributing S to P(sum)')."""
    a, b = _X.clone(), _Y.clone()
    case = prepare([a, b], [self_pl, other_pl], mesh_shape, _gen(_seed("iadd", repr(self_pl))))

    def body():
        mesh = init_device_mesh("cpu", mesh_shape)
        x, y = (make_dtensor(p, mesh, False) for p in case)
        x.add_(y)
        return x.full_tensor()
    for full in run_spmd(body, mesh_shape_numel(mesh_shape), timeout=TIMEOUT):
        close(full, a + b, "P.add_(S)", None)


@pytest.mark.parametrize("name,fn,n_reduce", [
    ("logsigmoid", F.logsigmoid, 1),  # minimum(0, x) and abs(x) each need x whole: it moves once
    ("aminmax", lambda a: torch.aminmax(a), 1),
    ("prelu of a Partial weight", None, 1),
])
def test_a_decomposition_moves_a_shared_input_once(name, fn, n_reduce):
    """Ops a decomposition emits share the moves of one input (a Partial reduced once, not once
    per op that needs it whole); prelu's kernel is elementwise, so its small weight is reduced,
    not the input.  Values equal one device."""
    x, w = data("any", (8, 6), _gen(11)), torch.tensor(0.25)
    if fn is None:
        def fn(a, b=None):
            return F.prelu(a, b if b is not None else w)

    def body(mesh):
        if name.startswith("prelu"):
            args = (distribute_tensor(x, mesh, [Replicate()]), DTensor.from_local(w / 4, mesh, [Partial()]))
        else:
            args = (DTensor.from_local(x / 4, mesh, [Partial()]),)
        with st.comm.scope("op"):
            y = fn(*args)
        return [t.full_tensor() for t in (y if isinstance(y, tuple) else (y,))]
    out, events = run_recorded((4,), body)
    moved = [e for e in events if e.rank == 0 and "op" in e.scope]
    assert len(moved) == n_reduce, (name, moved)
    if name.startswith("prelu"):
        assert math.prod(moved[0].shape) == 1, moved  # the one-element weight moved, not the (8, 6) input
    dense = fn(x, w) if name.startswith("prelu") else fn(x)
    for outs in out:
        for a, b in zip(outs, dense if isinstance(dense, tuple) else (dense,)):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fn", [F.binary_cross_entropy, F.binary_cross_entropy_with_logits], ids=lambda f: f.__name__)
def test_binary_cross_entropy_reduces_a_partial_input_once(fn):
    """Both BCE decompositions feed ``self`` to two non-linear branches (``log(x)`` and
    ``log1p(-x)``; ``minimum(0, x)`` beside a Partial ``zeros_like(x)``): a Partial ``self`` is
    reduced once, first, not once per branch; the loss is one device's."""
    x = torch.rand(6, generator=_gen(31)) * 0.8 + 0.1
    t = torch.rand(6, generator=_gen(32))

    def body(mesh):
        dx = DTensor.from_local(x / 4, mesh, [Partial()])
        dt = distribute_tensor(t, mesh, [Replicate()])
        with st.comm.scope("op"):
            loss = fn(dx, dt)
        return loss.full_tensor()
    out, events = run_recorded((4,), body)
    assert len([e for e in events if e.rank == 0 and "op" in e.scope]) == 1
    for loss in out:
        torch.testing.assert_close(loss, fn(x, t))


def test_dist_reduces_a_partial_that_broadcasting_enlarges():
    """``dist(x, y)`` of a Partial vector and a replicated batch reduce-scatters the vector at
    its own size, not the batch-sized difference (25x the bytes); a plain ``x - y`` keeps the Partial, as
    torch's DTensor does (0 bytes: a product or a sum that follows keeps it too)."""
    x, y = data("any", (5,), _gen(21)), data("any", (5, 5, 5), _gen(22))

    def body(mesh):
        dx = DTensor.from_local(x / 4, mesh, [Partial()])
        dy = distribute_tensor(y, mesh, [Replicate()])
        with st.comm.scope("dist"):
            d = torch.dist(dx, dy)
        with st.comm.scope("sub"):
            kept = dx - dy
        return d.full_tensor(), tuple(kept.placements), kept.full_tensor()
    out, events = run_recorded((4,), body)
    moved = [e for e in events if e.rank == 0 and "dist" in e.scope]
    assert [e.kind for e in moved] == ["reduce_scatter"] and moved[0].bytes_received <= 2 * 5 * 4, moved  # the difference: 125 * 4 B
    assert not [e for e in events if "sub" in e.scope]
    for d, kept_pl, kept in out:
        torch.testing.assert_close(d, torch.dist(x, y))
        assert kept_pl == (Partial(),)
        torch.testing.assert_close(kept, x - y)
