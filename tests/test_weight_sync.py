"""``WeightSync``: a state dict pushed between meshes by two sides that each know only their own
layout (an RL trainer and its inference workers), and the weight-sync example built on it."""
from __future__ import annotations

import pytest
import torch

from distributed import gloo_available
from shardtensor import DeviceMesh, Replicate, Shard, WeightSync, comm, distribute_tensor, run_spmd

pytestmark = pytest.mark.main_release  # our own algorithms: the main torch release runs them (tests/conftest.py)


def _sides(case):
    me = comm.current_transport().rank
    a, b = DeviceMesh("cpu", [[0, 1], [2, 3]]), DeviceMesh("cpu", [3, 4, 5])
    dense = {"w": torch.arange(42.).reshape(7, 6), "v": torch.arange(5.)}
    src = {"w": distribute_tensor(dense["w"], a, [Shard(0), Shard(1)]),
           "v": distribute_tensor(dense["v"], a, [Replicate(), Shard(0)])}
    out_dense = dict(dense)
    if case == "shape" and me in (3, 4, 5):
        out_dense["v"] = torch.arange(6.)
    if case == "dtype" and me in (3, 4, 5):
        out_dense["w"] = out_dense["w"].double()
    if case == "names" and me in (3, 4, 5):
        out_dense["u"] = out_dense.pop("v")
    out = {k: distribute_tensor(torch.zeros_like(v), b, [Shard(0)]) for k, v in out_dense.items()}
    return a, b, dense, src, out


def _body(case):
    me = comm.current_transport().rank
    a, b, dense, src, out = _sides(case)
    sync = WeightSync(a, b)
    in_a, in_b = a.get_coordinate() is not None, b.get_coordinate() is not None
    with comm.recording() as log:
        try:  # each side passes only what it holds
            for _ in range(2):
                sync(src=src if in_a else None, out=out if in_b else None)
        except ValueError as e:
            moved = sum(ev.bytes_sent for ev in log.events if ev.rank == me and "move" in ev.scope)
            return "error", str(e), moved
    moved = sum(ev.bytes_received for ev in log.events if ev.rank == me and "move" in ev.scope)
    return "ok", {k: torch.equal(v.full_tensor(), dense[k]) for k, v in out.items()} if in_b else None, moved


def test_each_side_passes_only_its_own_state_dict():
    res = run_spmd(_body, 8, "ok")
    for r in (3, 4, 5):
        assert res[r][0] == "ok" and all(res[r][1].values()), res[r]
    assert sum(1 for r in res if r[0] == "ok") == 8 and res[4][2] > 0  # the error checks below see moves


@pytest.mark.parametrize("case,words", [("shape", "has shape (5,) in src and (6,)"),
                                        ("dtype", "torch.float64 in out"), ("names", "different names")])
def test_mismatched_state_dicts_fail_on_every_rank_before_any_weight_moves(case, words):
    res = run_spmd(_body, 8, case)
    for r in range(6):  # every rank of either mesh; ranks 6 and 7 are in neither
        kind, msg, moved = res[r]
        assert kind == "error" and words in msg and moved == 0, (r, res[r])


def test_the_weight_sync_example_in_the_simulated_world(capsys):
    from shardtensor.examples.weight_sync import main

    assert main("sim", steps=2) == 0
    out = capsys.readouterr().out
    assert "(equal to the bytes sent)" in out and "every inference weight exact after every step" in out


@pytest.mark.skipif(not gloo_available(), reason="gloo not available")
def test_the_weight_sync_example_in_gloo_processes(capsys):
    from shardtensor.examples.weight_sync import main

    assert main("gloo", steps=2) == 0
    assert "every inference weight exact after every step" in capsys.readouterr().out
