"""Redistribution: plan a sequence of collectives between two specs, then execute it.

``planner.py`` (the one entry, cached) -> ``search.py`` (the cheapest per-mesh-dim plan) ->
``flatten.py`` / ``exchange.py`` (collectives over several mesh dims) -> ``execute.py``.  A
placement the planner does not move (``placement.planned``), and a move to another mesh, go by
an exchange of blocks instead: ``crossmesh.py`` plans it, ``move.py`` runs it (and holds
``redistribute_local``, which picks the way).
"""
from .cost import LinkModel, plan_cost
from .execute import apply_step
from .explain import Explanation, explain_redistribute, parse_placements
from .move import redistribute_local
from .planner import plan, plan_for
from .steps import Step, transition_kind

__all__ = ["Step", "plan", "plan_for", "plan_cost", "LinkModel", "apply_step", "redistribute_local",
           "transition_kind", "Explanation", "explain_redistribute", "parse_placements"]
