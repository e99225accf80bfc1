"""Batched linalg, cdist and FFTs on DTensors: values and gradients against one device, batch
shards kept (no fallback), matrices and transformed dims gathered."""
from __future__ import annotations

import warnings

import pytest
import torch

from opcheck import MESHES, check, data, gen, run_recorded

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, run_spmd, init_device_mesh
from shardtensor.errors import ReplicateFallbackWarning

R, S0, S1, S2, PS = Replicate(), Shard(0), Shard(1), Shard(2), Partial("sum")
TOL = {"rtol": 1e-3, "atol": 1e-3}


def _spd(shape, seed):
    a = data("any", shape, gen(seed))
    return a @ a.mT + shape[-1] * torch.eye(shape[-1])


def _batch_kept(seen, ndim_batch=1):
    for ins, outs in seen:
        want = tuple(p if isinstance(p, Shard) and p.dim < ndim_batch else R for p in ins[0])
        flat = outs if isinstance(outs[0], tuple) else (outs,)
        assert all(o is None or o == want for o in flat), (ins, outs)


LINALG = [
    ("inv", lambda a: torch.linalg.inv(a), "spd"),
    ("det", lambda a: torch.linalg.det(a), "spd"),
    ("slogdet", lambda a: torch.linalg.slogdet(a)[1], "spd"),
    ("cholesky", lambda a: torch.linalg.cholesky(a), "spd"),
    ("lu_factor", lambda a: torch.linalg.lu_factor(a)[0], "spd"),
    ("lu", lambda a: torch.linalg.lu(a)[2], "spd"),
    ("matrix_exp", lambda a: torch.linalg.matrix_exp(a * 0.1), "any"),
    ("cholesky_inverse", lambda a: torch.cholesky_inverse(torch.linalg.cholesky(a)), "spd"),
]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name,fn,kind", LINALG, ids=[x[0] for x in LINALG])
def test_batched_linalg_one_input(mesh, name, fn, kind):
    # 5 batches over 4 ranks (uneven, one rank with a single matrix or none on (2, 2))
    x = _spd((5, 4, 4), name) if kind == "spd" else data("any", (5, 4, 4), gen(name))
    check(fn, [x], mesh, limit=6, tol=TOL, grad_tol={"rtol": 5e-3, "atol": 5e-3})


SOLVES = [
    ("solve", lambda a, b: torch.linalg.solve(a, b)),
    ("solve_vector", lambda a, b: torch.linalg.solve(a, b[..., 0])),
    ("solve_triangular", lambda a, b: torch.linalg.solve_triangular(torch.linalg.cholesky(a), b, upper=False)),
    ("cholesky_solve", lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(a))),
    ("lu_solve", lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b)),
]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name,fn", SOLVES, ids=[x[0] for x in SOLVES])
def test_batched_solves(mesh, name, fn):
    a, b = _spd((5, 4, 4), (name, "a")), data("any", (5, 4, 3), gen((name, "b")))
    check(fn, [a, b], mesh, limit=6, tol=TOL, grad_tol={"rtol": 5e-3, "atol": 5e-3})


def test_batch_sharded_linalg_runs_without_fallback_or_gathering():
    def body():
        mesh = init_device_mesh("cpu", (4,))
        a = distribute_tensor(_spd((8, 4, 4), "nf-a"), mesh, [S0])
        b = distribute_tensor(data("any", (8, 4, 2), gen("nf-b")), mesh, [S0])
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReplicateFallbackWarning)
            outs = [torch.linalg.solve(a, b), torch.linalg.inv(a), torch.linalg.det(a), torch.linalg.cholesky(a),
                    torch.linalg.eig(a)[0]]
        return [tuple(o.placements) for o in outs]
    for r in run_spmd(body, 4):
        assert all(p == (S0,) for p in r), r


def test_broadcast_batches_are_replicated():
    a, b = _spd((1, 4, 4), "bc-a"), data("any", (5, 4, 3), gen("bc-b"))
    check(lambda x, y: torch.linalg.solve(x, y), [a, b], (4,), limit=6, tol=TOL, grad=False)


def test_singular_matrix_raises_on_every_rank():
    def body():
        mesh = init_device_mesh("cpu", (4,))
        x = torch.eye(3).repeat(4, 1, 1)
        x[3] = 0  # only the last rank's matrix is singular
        a = distribute_tensor(x, mesh, [S0])
        try:
            torch.linalg.inv(a)
        except RuntimeError as e:
            return "singular" in str(e) or "not invertible" in str(e)
        return False
    assert run_spmd(body, 4) == [True] * 4


@pytest.mark.parametrize("mesh", MESHES)
def test_cdist(mesh):
    x1, x2 = data("any", (3, 7, 4), gen("cd1")), data("any", (3, 5, 4), gen("cd2"))
    seen = check(lambda a, b: torch.cdist(a, b), [x1, x2], mesh, limit=10, tol=TOL, grad_tol=TOL)
    for _, out in seen:
        assert not any(isinstance(o, Partial) for o in out), out  # the feature dim is never split


FFTS = [
    ("fft", lambda a: torch.view_as_real(torch.fft.fft(a, dim=1)), (5, 6, 3)),
    ("rfft", lambda a: torch.view_as_real(torch.fft.rfft(a, dim=-1)), (5, 3, 6)),
    ("irfft", lambda a: torch.fft.irfft(a, n=6, dim=1), (5, 4, 3)),
    ("fft2", lambda a: torch.view_as_real(torch.fft.fft2(a)), (5, 4, 6)),
    ("ifftn", lambda a: torch.view_as_real(torch.fft.ifftn(a, dim=(0, 2))), (4, 5, 6)),
]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name,fn,shape", FFTS, ids=[x[0] for x in FFTS])
def test_fft_keeps_untransformed_dims(mesh, name, fn, shape):
    check(fn, [data("any", shape, gen(name))], mesh, limit=8, tol=TOL, grad_tol=TOL)


def test_fft_of_batch_sharded_signal_moves_nothing():
    def body():
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(data("any", (8, 16), gen("fft-b")), mesh, [S0])
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReplicateFallbackWarning)
            y = torch.fft.rfft(x, dim=1)
        return tuple(y.placements), torch.allclose(y.full_tensor(), torch.fft.rfft(x.full_tensor(), dim=1))
    assert run_spmd(body, 4) == [((S0,), True)] * 4


@pytest.mark.parametrize("shape", [(3, 0, 0), (0, 4)])
def test_plain_result_of_a_cpp_composite_is_a_replicated_dtensor(shape):
    """matrix_rank of empty matrices: torch's C++ builds the zeros from the shape alone, a plain
    tensor; it comes back as a Replicate DTensor (not a wrapper without a spec)."""
    x = torch.zeros(shape)
    dense = torch.linalg.matrix_rank(x)

    def body():
        mesh = init_device_mesh("cpu", (2, 2))
        out = torch.linalg.matrix_rank(distribute_tensor(x, mesh, [S0, R]))
        return type(out).__name__, tuple(out.placements), out.full_tensor(), (out + 1).full_tensor()

    for name, pls, full, plus in run_spmd(body, 4):
        assert name == "DTensor" and pls == (R, R)
        assert torch.equal(full, dense) and torch.equal(plus, dense + 1)


NONSYMMETRIC = [
    ("det", lambda a: torch.linalg.det(a)),
    ("slogdet", lambda a: torch.linalg.slogdet(a)[1]),
    ("logdet", lambda a: torch.logdet(a)),
    ("inv", lambda a: torch.linalg.inv(a)),
    ("lu_factor", lambda a: torch.linalg.lu_factor(a)[0]),
    ("det_of_transposed", lambda a: torch.linalg.det(a.mT)),
]


@pytest.mark.parametrize("n", [4, 5], ids=["even", "uneven"])
@pytest.mark.parametrize("name,fn", NONSYMMETRIC, ids=[x[0] for x in NONSYMMETRIC])
def test_linalg_on_sharded_matrix_dims_matches_one_device(name, fn, n):
    """Every placement of a non-symmetric matrix (columns sharded, one column per rank included):
    kernels such as ``linalg_det`` pick their factorization by the local tensor's memory layout and
    their backward by the DTensor's, so a gather must leave the layout the DTensor reports."""
    a = data("any", (n, n), gen(name)) + n * torch.eye(n)
    a = a + torch.triu(torch.ones(n, n), 1)  # clearly non-symmetric: LU of A and of A^T differ
    if name == "logdet":
        a = a @ a.mT + torch.triu(torch.ones(n, n), 1) * 0.1
    for mesh in MESHES:
        check(fn, [a], mesh, limit=None, tol=TOL, grad_tol={"rtol": 5e-3, "atol": 5e-3})


@pytest.mark.parametrize("mesh", MESHES)
def test_cross_makes_its_dim_whole_once(mesh):
    """linalg.cross over a sharded dim: each operand is made whole along it once, by the cheapest
    move (an all-to-all to another dim), not gathered by each of its index_selects; forward and
    backward against one device, broadcast operands included."""
    a, b = data("any", (5, 3), gen("cr1")), data("any", (5, 3), gen("cr2"))
    check(lambda x, y: torch.linalg.cross(x, y), [a, b], mesh, limit=12, seed="cross")
    c = data("any", (1, 3), gen("cr3"))
    check(lambda x, y: torch.linalg.cross(x, y), [a, c], mesh, limit=8, seed="cross-b")

    def body():
        m = init_device_mesh("cpu", (4,))
        x, y = distribute_tensor(a, m, [Shard(1)]), distribute_tensor(b, m, [Replicate()])
        from shardtensor import comm
        with comm.recording() as log:
            z = torch.linalg.cross(x, y)
        return [e.kind for e in log.of_rank(m.get_rank())], z.full_tensor()
    for kinds, full in run_spmd(body, 4):
        assert kinds == ["all_to_all"] and torch.allclose(full, torch.linalg.cross(a, b))


RHS_LINEAR = [  # X linear in B: B's Partial kept, B's columns (rows where left=False) sharded
    ("solve", lambda a, b: torch.linalg.solve(a, b)),
    ("solve_right", lambda a, b: torch.linalg.solve(a, b.mT, left=False)),
    ("solve_vector", lambda a, b: torch.linalg.solve(a, b[..., 0])),
    ("solve_triangular_right", lambda a, b: torch.linalg.solve_triangular(
        torch.linalg.cholesky(a), b.mT, upper=False, left=False)),
    ("triangular_solve", lambda a, b: torch.triangular_solve(b, torch.linalg.cholesky(a), upper=False)[0]),
    ("ldl_solve", lambda a, b: torch.linalg.ldl_solve(*torch.linalg.ldl_factor(a), b)),
    ("ormqr", lambda a, b: torch.ormqr(*torch.geqrf(a), b)),
    ("ormqr_right", lambda a, b: torch.ormqr(*torch.geqrf(a), b.mT, left=False, transpose=True)),
]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name,fn", RHS_LINEAR, ids=[x[0] for x in RHS_LINEAR])
def test_solves_linear_in_the_right_hand_side(mesh, name, fn):
    a, b = _spd((2, 4, 4), (name, "a")), data("any", (2, 4, 5), gen((name, "b")))
    grad = not name.startswith(("ldl", "ormqr"))  # torch has no derivative for ldl_factor, geqrf
    check(fn, [a, b], mesh, limit=10, tol=TOL, grad=grad, grad_tol={"rtol": 5e-3, "atol": 5e-3})


BATCH = (2, 4, 4)  # one B for every matrix of A's batch: X_i = A_i⁻¹ Σ B_k = Σ A_i⁻¹ B_k, still linear


@pytest.mark.parametrize("name,fn,bpl,want,a_shape", [
    ("solve P", lambda a, b: torch.linalg.solve(a, b), PS, PS, (4, 4)),
    ("solve columns", lambda a, b: torch.linalg.solve(a, b), Shard(1), Shard(1), (4, 4)),
    ("solve left=False rows", lambda a, b: torch.linalg.solve(a, b.mT.contiguous(), left=False), Shard(1), Shard(0),
     (4, 4)),
    ("vector P", lambda a, b: torch.linalg.solve(a, b[:, 0]), PS, PS, (4, 4)),
    ("cholesky_solve columns", lambda a, b: torch.cholesky_solve(b, a), Shard(1), Shard(1), (4, 4)),
    ("lu_solve P", lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b), PS, PS, (4, 4)),
    ("ldl_solve P over A's batch", lambda a, b: torch.linalg.ldl_solve(*torch.linalg.ldl_factor(a), b), PS, PS, BATCH),
    ("solve P over A's batch", lambda a, b: torch.linalg.solve(a, b), PS, PS, BATCH),
    ("cholesky_solve P over A's batch", lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(a)), PS, PS, BATCH),
])
def test_right_hand_side_partial_or_columns_move_nothing(name, fn, bpl, want, a_shape):
    """A Partial B stays Partial and a column-sharded B gives column-sharded X: no collective
    (before, B was all-reduced or gathered; a Partial B broadcast over A's batch too: 600 B on
    OpInfo's ldl_solve sample); values equal one device."""
    a, b = _spd(a_shape, "rhs-a"), data("any", (4, 8), gen("rhs-b"))

    def body(mesh):
        da = distribute_tensor(a, mesh, [R])
        db = DTensor.from_local(b / 4, mesh, [PS]) if bpl == PS else distribute_tensor(b, mesh, [bpl])
        with comm.scope("op"):
            y = fn(da, db)
        return tuple(y.placements), y.full_tensor()
    out, events = run_recorded((4,), body)
    assert [e for e in events if "op" in e.scope] == []
    for pl, full in out:
        assert pl == (want,)
        torch.testing.assert_close(full, fn(a, b), **TOL)
