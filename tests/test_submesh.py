"""A mesh over some ranks of the world (pipeline stages): ranks outside it hold nothing and run nothing.

In a world of 4, ``DeviceMesh("cpu", [0, 2])``: on ranks 0 and 2 every op gives single-device
values; on ranks 1 and 3 ``from_local`` and ``distribute_tensor`` hold an empty local tensor, ops
run no kernel and no collective and return placeholders (``True`` for ``equal``, zero for 0-d
results and ``item``), and ``redistribute`` does nothing.  A gloo twin lives in test_gloo.
"""
from __future__ import annotations

import pytest
import torch

from shardtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, comm, distribute_tensor, run_spmd

FULL = torch.arange(12.0).reshape(4, 3)


def _seen(x):
    """What a rank sees of a result: (global shape, local tensor, full value or None off the mesh)."""
    if not isinstance(x, DTensor):
        return x
    full = x.full_tensor()
    return tuple(x.shape), x.to_local().detach(), full.detach()


def _body():
    mesh = DeviceMesh("cpu", [0, 2])
    member = mesh.get_coordinate() is not None
    x = distribute_tensor(FULL, mesh, [Shard(0)])
    y = DTensor.from_local(torch.ones(2, 3) * (mesh.get_rank() + 1), mesh, [Partial()], run_check=False)
    w = distribute_tensor(FULL.clone(), mesh, [Shard(1)]).requires_grad_()
    with comm.scope("ops"):
        out = {
            "x_local": tuple(x.to_local().shape), "y_local": tuple(y.to_local().shape),
            "sum": x.sum(), "equal": torch.equal(x, x + 1), "item": y.sum().item(),
            "mm": (x @ w.t()).redistribute(mesh, [Replicate()]), "amax0": x.amax(0), "mean": (y * 2).mean(),
        }
        (w * w).sum().backward()
        out["grad"] = w.grad
        z = x.clone()
        z.mul_(3)
        out["inplace"] = z
        out = {k: _seen(v) for k, v in out.items()}
    return member, out


def test_submesh_members_compute_and_others_hold_nothing():
    want = {"sum": FULL.sum(), "mm": FULL @ FULL.t(), "amax0": FULL.amax(0), "mean": torch.tensor(8.0),
            "grad": 2 * FULL, "inplace": 3 * FULL}
    with comm.recording() as log:
        results = run_spmd(_body, 4)
    for rank, (member, out) in enumerate(results):
        assert member == (rank in (0, 2))
        if member:
            assert out["x_local"] == (2, 3) and out["y_local"] == (2, 3)
            assert out["equal"] is False and out["item"] == 24.0  # rank 0 holds ones, rank 2 threes
            for k, v in want.items():
                assert out[k][0] == tuple(v.shape) and torch.equal(out[k][2], v), k
        else:
            assert out["x_local"] == (0,) and out["y_local"] == (0,)
            assert out["equal"] is True and out["item"] == 0.0
            for k, v in want.items():
                shape, local, full = out[k]
                assert shape == tuple(v.shape), k  # the global shape is known everywhere
                assert local.shape == full.shape == (() if v.ndim == 0 else (0,)), k
                assert local.sum().item() == 0.0, k
    ops = [e for e in log.events if "ops" in e.scope and e.kind != "barrier"]
    assert ops and {e.rank for e in ops} == {0, 2}


def test_submesh_placeholders_keep_specs_and_dtypes():
    def body():
        mesh = DeviceMesh("cpu", [1, 3])
        x = distribute_tensor(torch.ones(5, 2, dtype=torch.bfloat16), mesh, [Shard(0)])
        b = x > 0
        return x.placements, b.dtype, b.to_local().dtype, tuple(b.shape), b.to_local().numel()

    out = run_spmd(body, 4)
    assert out[1] == ((Shard(0),), torch.bool, torch.bool, (5, 2), 6)
    assert out[0] == ((Shard(0),), torch.bool, torch.bool, (5, 2), 0)


@pytest.mark.parametrize("run_check", [None, True])
def test_from_local_on_a_submesh_checks_members_only(run_check):
    """Uneven pieces on ranks 0 and 2 give the global shape; ranks 1 and 3 take no part."""
    def body():
        mesh = DeviceMesh("cpu", [0, 2])
        x = DTensor.from_local(torch.ones(2 if mesh.get_rank() == 0 else 1, 2), mesh, [Shard(0)],
                               run_check=run_check)
        return tuple(x.shape), tuple(x.to_local().shape)

    assert run_spmd(body, 4) == [((3, 2), (2, 2)), ((2, 2), (0,)), ((3, 2), (1, 2)), ((2, 2), (0,))]
