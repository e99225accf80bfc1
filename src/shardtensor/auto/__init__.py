"""Auto-sharding: ``autoshard(model, mesh, example_inputs)`` chooses FSDP, HSDP and TP layouts per
unit of a model from exact prices of one training step, and returns a plan that applies itself
(docs/autoshard.md).

Modules, read top-down: ``plan.py`` (the entry point and the plan object), ``solve.py`` (which
plans, priced how, the choice), ``layout.py`` (a plan and its ``apply``), ``measure.py`` (one
training step on meta as rank 0 of a world of shapes: bytes, time, memory), ``model.py`` (repeated
blocks, cut-down copies, TP styles), ``report.py`` (the table).
"""
from .layout import Layout, Unit
from .measure import Cost, Device
from .plan import AutoPlan, autoshard

__all__ = ["AutoPlan", "Cost", "Device", "Layout", "Unit", "autoshard"]
