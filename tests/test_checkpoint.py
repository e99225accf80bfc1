"""Checkpoints: DTensors through torch.distributed.checkpoint (DCP) and torch.save/torch.load.

DCP runs in real gloo processes (it needs a torch.distributed process group): a state dict is
saved on one mesh/placement layout and loaded into DTensors of another, and every loaded value
must equal the saved one bit for bit.  ``torch.load(weights_only=True)`` is checked in the
simulated world.
"""
from __future__ import annotations

import io

import pytest
import torch

from distributed import gloo_available, run_multiprocess  # noqa: E402

from shardtensor import (DTensor, Partial, RaggedShard, Replicate, Shard, StridedShard, distribute_tensor,  # noqa: E402
                         init_device_mesh, run_spmd)

WORLD = 4

# name -> (global shape, dtype); saved and loaded under the layouts below
TENSORS = {
    "w": ((7, 5), torch.float32),       # uneven over 4 and over 2
    "b": ((3,), torch.bfloat16),        # fewer rows than ranks: empty pieces
    "i": ((6, 4), torch.int64),
    "e": ((0, 3), torch.float32),       # empty
}

# (mesh shape, placements, shard order or None) per layout
LAYOUTS = {
    "S0 on (4,)": ((4,), [Shard(0)], None),
    "R on (4,)": ((4,), [Replicate()], None),
    "S1 on (4,)": ((4,), [Shard(1)], None),
    "(S0,S1) on (2,2)": ((2, 2), [Shard(0), Shard(1)], None),
    "(S0,S0) tp-first on (2,2)": ((2, 2), [Shard(0), Shard(0)], {0: [1, 0]}),
    "(R,S0) on (2,2)": ((2, 2), [Replicate(), Shard(0)], None),
    "SS0 packed on (4,)": ((4,), [StridedShard(0, 2)], None),   # several blocks per rank
    "(S1,SS0) on (2,2)": ((2, 2), [Shard(1), StridedShard(0, 3)], None),
    "RS0 on (4,)": ((4,), [RaggedShard(0, (3, 0, 1, 2))], None),   # uneven by choice, an empty piece
    "(RS1,S0) on (2,2)": ((2, 2), [RaggedShard(1, (1, 3)), Shard(0)], None),
}


def _value(name: str) -> torch.Tensor:
    shape, dtype = TENSORS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    x = torch.randn(shape, generator=g) * 100
    return x.to(dtype)


def _placements(layout: str, ndim: int):
    mesh_shape, pl, order = LAYOUTS[layout]
    pl = [Replicate() if (p.tensor_dim() or 0) >= ndim else p for p in pl]
    if order is not None and not all(isinstance(p, Shard) and p.dim == 0 for p in pl):
        order = None
    return mesh_shape, pl, order


def _state(layout: str, fill: bool) -> dict[str, DTensor]:
    """Every tensor of TENSORS in ``layout``: the values, or (``fill`` False) a garbage-filled target."""
    out = {}
    meshes = {}
    for name in TENSORS:
        full = _value(name)
        mesh_shape, pl, order = _placements(layout, full.ndim)
        mesh = meshes.setdefault(mesh_shape, init_device_mesh("cpu", mesh_shape))
        src = full if fill else torch.full_like(full, 7)
        out[name] = distribute_tensor(src, mesh, pl)
        if order:
            out[name] = out[name].redistribute(mesh, pl, shard_order=order)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _dcp_round_trip(rank: int, world: int, path: str, save_layout: str, load_layout: str):
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(save_layout, True), checkpoint_id=path)
    target = _state(load_layout, False)
    dcp.load(target, checkpoint_id=path)
    bad = []
    for name, t in target.items():
        if not torch.equal(_bits(t.full_tensor()), _bits(_value(name))):
            bad.append(name)
        if t.placements != _state(load_layout, False)[name].placements:
            bad.append(f"{name} placements")
    return bad


PAIRS = [("S0 on (4,)", "(S0,S1) on (2,2)"), ("(S0,S0) tp-first on (2,2)", "S1 on (4,)"),
         ("R on (4,)", "(S0,S0) tp-first on (2,2)"), ("(R,S0) on (2,2)", "R on (4,)"),
         ("SS0 packed on (4,)", "(S1,SS0) on (2,2)"), ("(S1,SS0) on (2,2)", "S0 on (4,)"),
         ("RS0 on (4,)", "(S0,S1) on (2,2)"), ("S0 on (4,)", "RS0 on (4,)"), ("(RS1,S0) on (2,2)", "RS0 on (4,)")]


@pytest.mark.skipif(not gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("save_layout,load_layout", PAIRS)
def test_dcp_saves_on_one_layout_and_loads_on_another(tmp_path, save_layout, load_layout):
    res = run_multiprocess(_dcp_round_trip, WORLD, timeout=120, args=(str(tmp_path / "ckpt"), save_layout, load_layout))
    assert res == [[]] * WORLD, res


def _partial_refused(rank: int, world: int, path: str):
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (world,))
    p = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    try:
        dcp.save({"p": p}, checkpoint_id=path)
    except BaseException as e:  # noqa: BLE001 - DCP wraps it in CheckpointException, a BaseException
        return str(e)
    return "saved"


@pytest.mark.skipif(not gloo_available(), reason="needs gloo")
def test_dcp_refuses_a_partial_dtensor(tmp_path):
    res = run_multiprocess(_partial_refused, WORLD, timeout=120, args=(str(tmp_path / "ckpt"),))
    assert all("Partial" in r and "redistribute" in r for r in res), res


def _torch_save_load(layout: str):
    state = _state(layout, True)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    return [(name, torch.equal(_bits(t.to_local()), _bits(state[name].to_local())), t.placements == state[name].placements,
             t.shard_order == state[name].shard_order, type(t) is DTensor) for name, t in loaded.items()]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torch_load_weights_only_gives_back_the_dtensors(layout):
    for rows in run_spmd(_torch_save_load, WORLD, layout):
        assert [r[0] for r in rows] == list(TENSORS)
        assert all(all(r[1:]) for r in rows), rows


def _is_pinned():
    mesh = init_device_mesh("cpu", (WORLD,))
    return distribute_tensor(torch.ones(5, 2), mesh, [Shard(0)]).is_pinned()


def test_is_pinned_answers_for_the_local_block():
    assert run_spmd(_is_pinned, WORLD) == [False] * WORLD


def _model(kind: str, mesh1, mesh2):
    """TPMLP of test_fsdp under one parallelism: "tp" on (4,), "fsdp" on (4,), or "2d" (TP x FSDP on (2, 2))."""
    from test_fsdp import _tp_build

    from shardtensor.fsdp import fully_shard
    from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    m = _tp_build()
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if kind == "tp":
        parallelize_module(m, mesh1, plan)
    elif kind == "fsdp":
        fully_shard(m, mesh=mesh1)
    else:
        parallelize_module(m, mesh2["tp"], plan)
        fully_shard(m, mesh=mesh2["dp"])
    return m


def _model_round_trip(rank: int, world: int, path: str, save_kind: str, load_kind: str):
    import torch.distributed.checkpoint as dcp

    from test_fsdp import _tp_build

    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dcp.save(_model(save_kind, mesh1, mesh2).state_dict(), checkpoint_id=path)
    target = _model(load_kind, mesh1, mesh2)
    with torch.no_grad():
        for p in target.parameters():
            p.to_local().fill_(7) if isinstance(p, DTensor) else p.fill_(7)
    sd = target.state_dict()
    dcp.load(sd, checkpoint_id=path)
    want = dict(_tp_build().named_parameters())
    bad = [n for n, p in target.named_parameters()
           if not torch.equal(_bits(p.full_tensor() if isinstance(p, DTensor) else p), _bits(want[n].detach()))]
    return bad


@pytest.mark.skipif(not gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("save_kind,load_kind", [("tp", "fsdp"), ("fsdp", "2d"), ("2d", "tp")])
def test_model_state_dict_moves_between_tp_fsdp_and_2d(tmp_path, save_kind, load_kind):
    res = run_multiprocess(_model_round_trip, WORLD, timeout=120, args=(str(tmp_path / "ckpt"), save_kind, load_kind))
    assert res == [[]] * WORLD, res


# -- shardtensor.checkpoint.save / load: DCP's, in the simulated world too ---------------------

def _sim_round_trip(path: str, save_layout: str, load_layout: str):
    from shardtensor.checkpoint import load, save

    save(_state(save_layout, True), checkpoint_id=path)
    target = _state(load_layout, False)
    load(target, checkpoint_id=path)
    return [name for name, t in target.items()
            if not torch.equal(_bits(t.full_tensor()), _bits(_value(name)))
            or t.placements != _state(load_layout, False)[name].placements]


@pytest.mark.parametrize("save_layout,load_layout", PAIRS)
def test_save_and_load_reshard_in_the_simulated_world(tmp_path, save_layout, load_layout):
    assert run_spmd(_sim_round_trip, WORLD, str(tmp_path / "ckpt"), save_layout, load_layout) == [[]] * WORLD


def _sim_save(path: str, layout: str):
    from shardtensor.checkpoint import save

    save(_state(layout, True), checkpoint_id=path)


def _dcp_load(rank: int, world: int, path: str, layout: str):
    import torch.distributed.checkpoint as dcp

    target = _state(layout, False)
    dcp.load(target, checkpoint_id=path)
    return [name for name, t in target.items() if not torch.equal(_bits(t.full_tensor()), _bits(_value(name)))]


def test_a_simulated_checkpoint_is_dcps_format(tmp_path):
    """Saved by four simulated ranks; read back whole by DCP in one process with no process group."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    run_spmd(_sim_save, WORLD, path, "(S0,S0) tp-first on (2,2)")
    whole = {name: torch.full(shape, 7, dtype=dtype) for name, (shape, dtype) in TENSORS.items()}
    dcp.load(whole, checkpoint_id=path)
    assert all(torch.equal(_bits(t), _bits(_value(name))) for name, t in whole.items())


@pytest.mark.skipif(not gloo_available(), reason="needs gloo")
def test_saved_in_the_simulated_world_loaded_by_gloo_processes(tmp_path):
    path = str(tmp_path / "ckpt")
    run_spmd(_sim_save, WORLD, path, "S1 on (4,)")
    assert run_multiprocess(_dcp_load, WORLD, timeout=120, args=(path, "(R,S0) on (2,2)")) == [[]] * WORLD


def _sim_partial(path: str):
    from shardtensor.checkpoint import save

    mesh = init_device_mesh("cpu", (WORLD,))
    save({"p": DTensor.from_local(torch.ones(3), mesh, [Partial()])}, checkpoint_id=path)


def test_the_simulated_world_refuses_a_partial_dtensor(tmp_path):
    with pytest.raises(ValueError, match="Partial.*redistribute"):
        run_spmd(_sim_partial, WORLD, str(tmp_path / "ckpt"), timeout=30)
