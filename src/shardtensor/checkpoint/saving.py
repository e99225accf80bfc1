"""``save`` and ``load``: DCP checkpoints in every world, the simulated one included.

Under torch.distributed they are ``torch.distributed.checkpoint.save`` and ``load``.  The
simulated ranks of ``run_spmd`` are threads with no process group, so there DCP's own steps
run here, with DCP's public planners and storage: each rank plans its writes or reads, rank 0
merges the plans and writes the metadata, and the plans and results travel between the ranks
over the simulated world.  The files are the same either way: a checkpoint saved in the
simulated world loads under torchrun, and back.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from ..comm import SimTransport, current_sim_transport

__all__ = ["load", "save"]


def save(state_dict: dict[str, Any], *, checkpoint_id: Any = None, storage_writer: Any = None,
         planner: Any = None) -> Any:
    """``torch.distributed.checkpoint.save``, in the simulated world too; returns DCP's metadata."""
    import torch.distributed.checkpoint as dcp

    sim = _sim()
    if sim is None:
        return dcp.save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner)
    writer = storage_writer or dcp.FileSystemWriter(checkpoint_id)
    planner = planner or dcp.DefaultSavePlanner()
    me, coordinator = sim.rank, sim.rank == 0
    if "storage_meta" in inspect.signature(planner.set_up_planner).parameters:
        planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
    else:
        planner.set_up_planner(state_dict, coordinator)
    _call(writer.set_up_storage_writer, coordinator, rank=me)
    plans = sim.gather_objects(writer.prepare_local_plan(planner.create_local_plan()))
    meta = None
    if coordinator:
        plans, meta = planner.create_global_plan(plans)
        plans = writer.prepare_global_plan(plans)
    central, meta = sim.gather_objects((plans, meta))[0]
    writes = writer.write_data(planner.finish_plan(central[me]), planner)
    writes.wait()
    results = sim.gather_objects(writes.value())
    if coordinator:
        writer.finish(metadata=meta, results=results)
    sim.gather_objects(None)  # nobody returns before the metadata is on disk
    return meta


def load(state_dict: dict[str, Any], *, checkpoint_id: Any = None, storage_reader: Any = None,
         planner: Any = None) -> None:
    """``torch.distributed.checkpoint.load`` (in place), in the simulated world too."""
    import torch.distributed.checkpoint as dcp

    sim = _sim()
    if sim is None:
        dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader, planner=planner)
        return
    reader = storage_reader or dcp.FileSystemReader(checkpoint_id)
    planner = planner or dcp.DefaultLoadPlanner()
    me, coordinator = sim.rank, sim.rank == 0
    meta = reader.read_metadata()
    planner.set_up_planner(state_dict, meta, coordinator)
    _call(reader.set_up_storage_reader, meta, coordinator, rank=me)
    plans = sim.gather_objects(reader.prepare_local_plan(planner.create_local_plan()))
    if coordinator:
        plans = reader.prepare_global_plan(planner.create_global_plan(plans))
    central = sim.gather_objects(plans if coordinator else None)[0]
    reader.read_data(planner.finish_plan(central[me]), planner).wait()
    sim.gather_objects(None)


def _sim() -> SimTransport | None:
    t = current_sim_transport()
    return t if isinstance(t, SimTransport) else None


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, dropping the keywords an older torch's ``fn`` does not take."""
    if "kwargs" in inspect.signature(fn).parameters:
        return fn(*args, **kwargs)
    return fn(*args)
