"""Sharding propagation: (op, input specs, static args) -> Decision, cached.

- ``call.py``: the call as rules see it (:class:`Call`) and what they return (:class:`Decision`);
- ``registry.py``: which rule decides an op (:func:`register`, :func:`rule_for`);
- ``strategy.py``: what rules share -- candidates, their selection by cost, :func:`decide`;
- ``engine.py``: :func:`propagate`, the rule's decision from an LRU cache;
- ``rules/``: one module per op family (importing the package registers them).

Rules decide; they never run anything.  An op without a rule raises ``NotImplementedError``
naming the op and the input placements unless the dispatcher can decompose it.
"""
from __future__ import annotations

from ..errors import MeshMismatchError
from . import rules  # noqa: F401  (importing registers the rules)
from .call import Call, Decision, flatten_call, unflatten_call
from .engine import _freeze, cache_info, clear_cache, propagate
from .registry import RULES, TAG_RULES, register, rule_for, unsupported
from .strategy import Candidate, decide

__all__ = ["Call", "Decision", "register", "propagate", "RULES", "TAG_RULES", "clear_cache", "cache_info",
           "unsupported", "MeshMismatchError", "Candidate", "decide", "rule_for", "flatten_call", "unflatten_call"]
