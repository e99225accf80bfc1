"""The forward hooks that parallel styles and ``distribute_module`` install.

This is the one file of shardtensor that dynamo traces (``compile.py``): a compiled module
runs its hooks inside its graph, and each hook only picks values and calls a function given to
it (a style's ``in_graph`` conversion, or a user's ``input_fn``), so a model with parallel
styles compiles into one graph.  Keep the bodies plain Python over tuples and dicts.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["ConvertInputs", "ConvertOutputs", "MeshPreHook", "MeshPostHook"]


class ConvertInputs:
    """Forward pre-hook: positional input ``i`` becomes ``convert(x, *rules[i])``.

    ``exact``: the module must get exactly ``len(rules)`` positional inputs; otherwise at least
    one, and those past the rules pass unchanged; ``rules=None`` leaves them all.  ``kw_rules`` (keyword name -> rule) makes it
    a pre-hook with kwargs; keywords without a rule pass unchanged.
    """

    def __init__(self, convert: Callable, rules: tuple | None, who: str, *, exact: bool = False,
                 kw_rules: dict[str, tuple] | None = None) -> None:
        self.convert, self.rules, self.who, self.exact, self.kw_rules = convert, rules, who, exact, kw_rules

    def _args(self, mod: Any, args: Any) -> tuple:
        if not isinstance(args, tuple):
            args = (args,)
        if self.rules is None:
            return args
        n = len(self.rules)
        if self.exact and len(args) != n:
            raise ValueError(f"{self.who}: the module got {len(args)} positional inputs but input_layouts has {n}")
        if not self.exact and not args:
            raise ValueError(f"{type(mod).__name__} was called without a positional input; parallel styles convert "
                             "the first positional argument")
        return tuple(self.convert(x, *rule) for x, rule in zip(args, self.rules)) + tuple(args[n:])

    def __call__(self, mod: Any, args: Any, kwargs: dict | None = None) -> Any:
        if self.kw_rules is None:
            return self._args(mod, args)
        assert kwargs is not None
        new = {k: (self.convert(v, *self.kw_rules[k]) if k in self.kw_rules else v) for k, v in kwargs.items()}
        return self._args(mod, args), new


class ConvertOutputs:
    """Forward hook: each output becomes ``convert(out, *rules[i])`` (one output: not a tuple);
    ``exact``: the module must return exactly ``len(rules)`` outputs."""

    def __init__(self, convert: Callable, rules: tuple, who: str, *, exact: bool = False) -> None:
        self.convert, self.rules, self.who, self.exact = convert, rules, who, exact

    def __call__(self, mod: Any, inputs: Any, outputs: Any) -> Any:
        if not self.exact:
            return self.convert(outputs, *self.rules[0])
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(outs) != len(self.rules):
            raise ValueError(f"{self.who}: the module returned {len(outs)} outputs but output_layouts "
                             f"has {len(self.rules)}")
        new = tuple(self.convert(x, *rule) for x, rule in zip(outs, self.rules))
        return new[0] if len(new) == 1 else new


class MeshPreHook:
    """``distribute_module``'s ``input_fn(module, inputs, mesh)`` (or ``(inputs, mesh)``) as a pre-hook."""

    def __init__(self, fn: Callable, mesh: Any, with_module: bool) -> None:
        self.fn, self.mesh, self.with_module = fn, mesh, with_module

    def __call__(self, mod: Any, inputs: Any) -> Any:
        return self.fn(mod, inputs, self.mesh) if self.with_module else self.fn(inputs, self.mesh)


class MeshPostHook:
    """``distribute_module``'s ``output_fn(module, outputs, mesh)`` (or ``(outputs, mesh)``) as a hook."""

    def __init__(self, fn: Callable, mesh: Any, with_module: bool) -> None:
        self.fn, self.mesh, self.with_module = fn, mesh, with_module

    def __call__(self, mod: Any, inputs: Any, outputs: Any) -> Any:
        return self.fn(mod, outputs, self.mesh) if self.with_module else self.fn(outputs, self.mesh)
