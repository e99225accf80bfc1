"""Redistribution: plan a sequence of single-mesh-dim transitions, then execute it."""
from .execute import apply_step, redistribute_local
from .planner import Step, plan, transition_kind

__all__ = ["Step", "plan", "apply_step", "redistribute_local", "transition_kind"]
