"""Whole-tensor model and optimizer state dicts (``shardtensor.checkpoint.state_dict``), against one device.

The model is test_fsdp's TPMLP under TP on (4,), FSDP on (4,) or TP x FSDP on (2, 2).  A state
dict taken under one parallelism must equal the single-device model's, and load into another.
"""
from __future__ import annotations


import pytest
import torch

from test_checkpoint import _model  # noqa: E402
from test_fsdp import _tp_batch, _tp_build  # noqa: E402

from shardtensor import DTensor, init_device_mesh, run_spmd  # noqa: E402
from shardtensor.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,  # noqa: E402
                                               get_optimizer_state_dict, set_model_state_dict,
                                               set_optimizer_state_dict)

WORLD = 4
KINDS = ["tp", "fsdp", "2d"]


def _meshes():
    return init_device_mesh("cpu", (WORLD,)), init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _step(model, opt, s: int) -> None:
    """One Adam step on the whole batch (every rank feeds the same batch: a replicated input)."""
    x, y = _tp_batch(s)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()


def _reference(steps: int):
    m = _tp_build()
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    for s in range(steps):
        _step(m, o, s)
    return m, o


def _full_model_sd(kind: str, offload: bool):
    m = _model(kind, *_meshes())
    return get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))


@pytest.mark.parametrize("kind", KINDS)
def test_full_model_state_dict_equals_the_single_device_model(kind):
    want = _tp_build().state_dict()
    for sd in run_spmd(_full_model_sd, WORLD, kind, False):
        assert sd.keys() == want.keys()
        for k, v in sd.items():
            assert type(v) is torch.Tensor and torch.equal(v, want[k]), k


def test_cpu_offload_gives_rank_0_the_tensors_and_the_others_nothing():
    out = run_spmd(_full_model_sd, WORLD, "2d", True)
    assert out[1:] == [{}] * (WORLD - 1)
    assert all(v.device.type == "cpu" and type(v) is torch.Tensor for v in out[0].values())


def _sharded_sd(kind: str):
    m = _model(kind, *_meshes())
    sd = get_model_state_dict(m)
    params = dict(m.named_parameters())
    return {k: (type(v) is DTensor, v.placements == params[k].placements) for k, v in sd.items()
            if isinstance(params[k], DTensor)}


def test_default_options_keep_the_dtensors():
    for sd in run_spmd(_sharded_sd, WORLD, "tp"):
        assert sd["up.weight"] == (True, True) and sd["down.weight"] == (True, True)


def _load_full(kind: str, from_rank0: bool):
    m = _model(kind, *_meshes())
    with torch.no_grad():
        for p in m.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).fill_(3)
    rank = m.up.weight.device_mesh.get_rank() if isinstance(m.up.weight, DTensor) else 0
    sd = _tp_build().state_dict() if (rank == 0 or not from_rank0) else {}
    res = set_model_state_dict(m, sd, options=StateDictOptions(broadcast_from_rank0=from_rank0))
    return list(res.missing_keys), {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach())
                                    for n, p in m.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("from_rank0", [False, True])
def test_set_model_state_dict_lays_whole_tensors_out_like_the_model(kind, from_rank0):
    want = dict(_tp_build().named_parameters())
    for missing, params in run_spmd(_load_full, WORLD, kind, from_rank0):
        assert missing == []
        for n, p in params.items():
            assert torch.equal(p, want[n].detach()), n


def _optim_round_trip(save_kind: str, load_kind: str):
    """Train one step under ``save_kind``, move model and Adam state to ``load_kind``, train one more."""
    m1 = _model(save_kind, *_meshes())
    o1 = torch.optim.Adam(m1.parameters(), lr=0.01)
    _step(m1, o1, 0)
    full = StateDictOptions(full_state_dict=True)
    msd, osd = get_model_state_dict(m1, options=full), get_optimizer_state_dict(m1, o1, options=full)
    m2 = _model(load_kind, *_meshes())
    o2 = torch.optim.Adam(m2.parameters(), lr=0.01)
    set_model_state_dict(m2, msd)
    set_optimizer_state_dict(m2, o2, osd)
    _step(m2, o2, 1)
    return ({n: {k: v for k, v in st.items()} for n, st in osd["state"].items()},
            {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()) for n, p in m2.named_parameters()})


@pytest.mark.parametrize("save_kind,load_kind", [("tp", "fsdp"), ("fsdp", "2d"), ("2d", "tp")])
def test_optimizer_state_moves_between_parallelisms(save_kind, load_kind):
    ref1, ref_o1 = _reference(1)
    names = {id(p): n for n, p in ref1.named_parameters()}
    ref_state = {names[id(p)]: st for p, st in ref_o1.state.items()}
    ref2, _ = _reference(2)
    for state, params in run_spmd(_optim_round_trip, WORLD, save_kind, load_kind):
        assert state.keys() == ref_state.keys()
        for n, st in state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert type(st[k]) is torch.Tensor
                torch.testing.assert_close(st[k], ref_state[n][k], rtol=1e-5, atol=1e-7, msg=f"{n}.{k}")
        for n, p in ref2.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)


def _bad_shape():
    m = _model("tp", *_meshes())
    sd = _tp_build().state_dict()
    sd["up.weight"] = torch.zeros(3, 3)
    try:
        set_model_state_dict(m, sd)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_a_wrong_shape_is_named():
    assert all("'up.weight'" in r and "(3, 3)" in r for r in run_spmd(_bad_shape, WORLD))


def _gloo_helpers(rank: int, world: int):
    """In real processes: rank 0's offloaded full state dict, broadcast into a 2-D model from rank 0."""
    sd = get_model_state_dict(_model("fsdp", *_meshes()),
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    m = _model("2d", *_meshes())
    with torch.no_grad():
        for p in m.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).fill_(3)
    set_model_state_dict(m, sd, options=StateDictOptions(broadcast_from_rank0=True))
    want = dict(_tp_build().named_parameters())
    return len(sd), [n for n, p in m.named_parameters()
                     if not torch.equal(p.full_tensor() if isinstance(p, DTensor) else p.detach(), want[n].detach())]


def test_helpers_in_gloo_processes():
    from distributed import gloo_available, run_multiprocess

    if not gloo_available():
        pytest.skip("needs gloo")
    res = run_multiprocess(_gloo_helpers, WORLD, timeout=120)
    assert res == [(6, [])] + [(0, [])] * (WORLD - 1), res
