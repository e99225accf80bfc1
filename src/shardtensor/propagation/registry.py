"""The rule registry: which rule decides an op, found once per op overload.

A rule is a function ``rule(call: Call) -> Decision | list[Candidate]`` registered for op
overloads with :func:`register`, or found by op tag (every ``pointwise`` op).  An op with
neither has no rule; the dispatcher may still decompose it (``shardtensor/dispatch``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .call import Call, Decision, unsupported

__all__ = ["register", "rule_for", "needs_of", "unsupported", "RULES", "TAG_RULES", "SCALARS_BY_SIGN", "Rule"]


Rule = Callable[[Call], "Decision | list"]
RULES: dict[Any, Rule] = {}
TAG_RULES: list[tuple[torch.Tag, Rule]] = []
SCALARS_BY_SIGN: set[Any] = set()
_BY_SIGN: set[int] = set()  # ids of SCALARS_BY_SIGN (OpOverload hashes in Python; ids are cheap)
"""Ops whose decision depends on a Python scalar only through its type and sign: their cache
key holds ``(type, sign)`` so ``x * 2.0`` and ``x * 3.0`` share an entry."""


NEEDS: dict[Any, tuple[str, ...]] = {}
"""op -> the tensor arguments its rule needs as DTensors (checked before the rule runs)."""


def register(*ops: Any, scalars_by_sign: bool = False, needs: tuple[str, ...] = ()) -> Callable[[Rule], Rule]:
    """Decorator: ``@register(aten.add.Tensor, ...)`` makes ``fn`` the rule of those overloads.

    A rule returns a :class:`Decision` or a list of :class:`Candidate` (selected by cost).
    ``scalars_by_sign=True`` declares that only the type and sign of scalar arguments matter.
    ``needs`` names the tensor arguments the rule reads as DTensors (``call.spec(name)``): a
    call with a plain tensor there is refused before the rule runs, with the one error.
    """

    def deco(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
            NEEDS[op] = needs
            if scalars_by_sign:
                SCALARS_BY_SIGN.add(op)
                _BY_SIGN.add(id(op))
            _rule_of.pop(id(op), None)
        return fn

    return deco


def needs_of(op: Any) -> tuple[str, ...]:
    """The tensor arguments ``op``'s registered rule needs as DTensors."""
    return NEEDS.get(op, ())


def _is_out_overload(op) -> bool:
    return any(a.is_out for a in op._schema.arguments) if hasattr(op._schema.arguments[0], "is_out") else \
        op._overloadname.startswith("out")


def _find_rule(op) -> Rule | None:
    rule = RULES.get(op)
    if rule is None and not _is_out_overload(op):
        tags = op.tags
        for tag, fn in TAG_RULES:
            if tag in tags:
                if tag is torch.Tag.pointwise:
                    SCALARS_BY_SIGN.add(op)
                    _BY_SIGN.add(id(op))
                return fn
    return rule


_rule_of: dict[int, Any] = {}
"""id(op) -> its rule or None, resolved once per op (ops live forever; ``register`` forgets one)."""


def rule_for(op) -> Rule | None:
    """The rule that decides ``op``, or None when it has none."""
    r = _rule_of.get(id(op), _MISSING)
    if r is _MISSING:
        r = _rule_of[id(op)] = _find_rule(op)
    return r


_MISSING = object()
