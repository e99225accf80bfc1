"""Redistribution: plan a sequence of single-mesh-dim transitions, then execute it."""
from .cost import LinkModel, plan_cost
from .execute import apply_step, plan_for, redistribute_local
from .explain import Explanation, explain_redistribute, parse_placements
from .optimal import optimal_plan
from .planner import Step, plan, transition_kind

__all__ = ["Step", "plan", "optimal_plan", "plan_for", "plan_cost", "LinkModel", "apply_step", "redistribute_local",
           "transition_kind", "Explanation", "explain_redistribute", "parse_placements"]
