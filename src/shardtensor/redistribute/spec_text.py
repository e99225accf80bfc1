"""Specs as text: parse placements, shard orders and dtypes from strings (``"S0,P(max)"``,
``"S(0)[1],S(0)[0]"``, ``"0:1,0"``, ``"bf16"``), and format bytes, times and orders for
``shardtensor plan``'s tables and JSON."""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Mapping, Sequence

import torch

from ..placement import (PLACEMENTS, Partial, Placement, REDUCE_OPS, Replicate, Shard, ShardOrder, default_shard_order,
                         normalize_placements, shard_dim, validate_shard_order)

__all__ = ["int_tuple", "parse_dtype", "parse_spec", "parse_placements", "parse_shard_order", "resolve_spec", "format_bytes",
           "format_time"]


# -- parsing ------------------------------------------------------------------------------------

def int_tuple(what: str, value: Any, minimum: int) -> tuple[int, ...]:
    """``value`` (ints, or text like ``"2,2"`` / ``"(8,)"``) as a tuple of ints, each >= ``minimum``."""
    if isinstance(value, str):
        text = re.sub(r"\s+", "", value)
        if len(text) >= 2 and text[0] + text[-1] in ("()", "[]"):
            text = text[1:-1]
        parts = text.split(",") if text else []
        if parts and parts[-1] == "" and len(parts) > 1:
            parts.pop()  # "8," like a Python 1-tuple
        try:
            value = tuple(int(v) for v in parts)
        except ValueError:
            raise ValueError(f"{what} must be comma-separated integers like '2,2', got {value!r}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    try:
        out = tuple(value)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, got {value!r}") from None
    for v in out:
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{what} must be a sequence of ints, got {value!r}")
        if v < minimum:
            raise ValueError(f"{what} {out} has a size {v} < {minimum}")
    return out



_DTYPE_ALIASES = {
    "fp32": torch.float32, "f32": torch.float32, "float": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "f16": torch.float16, "half": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp64": torch.float64, "f64": torch.float64, "double": torch.float64, "float64": torch.float64,
}


def parse_dtype(dtype: Any) -> torch.dtype:
    """``torch.bfloat16``, ``"bf16"``, ``"float32"``, ``"torch.int8"``, ... -> a ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a torch.dtype or a name like 'bf16', got {dtype!r}")
    name = dtype.strip().lower().removeprefix("torch.")
    if name in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[name]
    found = getattr(torch, name, None)
    if isinstance(found, torch.dtype):
        return found
    raise ValueError(f"unknown dtype {dtype!r}; use a torch dtype name (float32, bfloat16, int8, ...) "
                     f"or one of {', '.join(sorted(_DTYPE_ALIASES))}")


_OPS = "|".join(REDUCE_OPS)
_TOKEN = re.compile(
    r"^(?:(?P<r>r|replicate(?:\(\))?)"
    rf"|(?P<p>p|partial(?:\(\))?|(?:p|partial)\((?:reduce_op=)?['\"]?(?P<op>{_OPS})['\"]?\))"
    r"|(?:s(?P<sd>-?\d+)|(?:s|shard)\((?:dim=)?(?P<sd2>-?\d+)\))(?:\[(?P<pos>\d+)\])?)$")


def _split_top(text: str) -> list[str]:
    """Split on commas outside parentheses/brackets (``"P(max),S1"`` -> ``["P(max)", "S1"]``)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced parentheses in placements {text!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced parentheses in placements {text!r}")
    parts.append(cur)
    return parts


def _strip_outer(text: str) -> str:
    """``"(S(0), R)"`` -> ``"S(0), R"`` (the display form's outer parentheses are optional)."""
    if text.startswith("(") and text.endswith(")"):
        depth = 0
        for i, ch in enumerate(text):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and i < len(text) - 1:
                return text  # "(...)...(...)": not one outer pair
        return text[1:-1]
    return text


def parse_spec(text: str, mesh_ndim: int) -> tuple[tuple[Placement, ...], dict[int, tuple[int, ...]]]:
    """Placements and the shard-order entries spelled in the display form (docs/placements.md).

    Accepts ``"S0,S1"``, ``"R,S0"``, ``"P,P"``, ``"P(max),S1"``, ``"(S(0), Shard(1))"``,
    ``"Replicate(), Partial(avg)"`` (case-insensitive, spaces ignored) and nested positions
    ``"S(0)[1],S(0)[0]"`` (mesh dim 1 splits tensor dim 0 first).  Returns the placements and
    ``{tensor dim: mesh dims, first-applied first}`` for the tensor dims given with positions.
    """
    if not isinstance(text, str):
        raise TypeError(f"placements text must be a str, got {text!r}")
    body = _strip_outer(re.sub(r"\s+", "", text))
    if not body:
        raise ValueError(f"empty placements {text!r}; give one per mesh dim, e.g. 'S0,R'")
    tokens = _split_top(body)
    out: list[Placement] = []
    pos: dict[int, int] = {}
    for j, tok in enumerate(tokens):
        m = _TOKEN.match(tok.lower())
        if m is None:
            other = next((p for cls in PLACEMENTS if (p := cls.from_text(tok.lower())) is not None), None)
            if other is None:
                raise ValueError(f"cannot parse placement {tok!r} (mesh dim {j}) in {text!r}; use R, S<d> / S(<d>), "
                                 f"P / P(<op>) with op in {', '.join(REDUCE_OPS)}, SS(<d>,<split factor>) or "
                                 "RS(<d>,<unit>:<unit>:...)")
            out.append(other)
        elif m.group("r"):
            out.append(Replicate())
        elif m.group("p"):
            out.append(Partial(m.group("op") or "sum"))
        else:
            out.append(Shard(int(m.group("sd") if m.group("sd") is not None else m.group("sd2"))))
            if m.group("pos") is not None:
                pos[j] = int(m.group("pos"))
    if len(out) != mesh_ndim:
        raise ValueError(f"got {len(out)} placements {text!r} for a mesh with {mesh_ndim} dims; "
                         "give exactly one placement per mesh dim")
    order: dict[int, tuple[int, ...]] = {}
    by_dim: dict[int, list[int]] = {}
    for j, p in enumerate(out):
        d = shard_dim(p)
        if d is not None:
            by_dim.setdefault(d, []).append(j)
    for d, js in by_dim.items():
        marked = [j for j in js if j in pos]
        if not marked:
            continue
        if len(marked) != len(js) or sorted(pos[j] for j in js) != list(range(len(js))):
            raise ValueError(f"positions of the mesh dims sharding tensor dim {d} in {text!r} must be "
                             f"[0]..[{len(js) - 1}], one per mesh dim")
        order[d] = tuple(sorted(js, key=lambda j: pos[j]))
    return tuple(out), order


def parse_placements(text: str, mesh_ndim: int) -> tuple[Placement, ...]:
    """``"S0,S1"`` / ``"R,S0"`` / ``"P,P"`` / ``"P(max),S1"`` -> placements, one per mesh dim.

    Raises ``ValueError`` for unknown tokens, unbalanced parentheses or the wrong count.
    Nested positions (``S(0)[1]``) are accepted but dropped here; ``parse_spec`` keeps them.
    """
    return parse_spec(text, mesh_ndim)[0]


def parse_shard_order(text: str) -> dict[int, tuple[int, ...]]:
    """``"0:1,0"`` -> ``{0: (1, 0)}``; several tensor dims separated by ``;`` (``"0:1,0;1:2"``)."""
    if not isinstance(text, str):
        raise TypeError(f"shard order text must be a str, got {text!r}")
    out: dict[int, tuple[int, ...]] = {}
    entries = [e for e in re.sub(r"\s+", "", text).split(";") if e]
    if not entries:
        raise ValueError(f"empty shard order {text!r}; use 'tensor_dim:mesh_dim,mesh_dim' e.g. '0:1,0'")
    for e in entries:
        m = re.fullmatch(r"(-?\d+):(\d+(?:,\d+)*)", e)
        if m is None:
            raise ValueError(f"cannot parse shard order entry {e!r} of {text!r}; use 'tensor_dim:mesh dims "
                             "first-applied first', e.g. '0:1,0', entries separated by ';'")
        d = int(m.group(1))
        if d in out:
            raise ValueError(f"shard order {text!r} lists tensor dim {d} twice")
        out[d] = tuple(int(x) for x in m.group(2).split(","))
    return out


def _order_entries(order: Any) -> dict[int, tuple[int, ...]]:
    if order is None:
        return {}
    if isinstance(order, str):
        return parse_shard_order(order)
    items = order.items() if isinstance(order, Mapping) else order
    try:
        entries = [(d, tuple(js)) for d, js in items]
    except (TypeError, ValueError):
        raise TypeError(f"shard order must be a str like '0:1,0', a dict {{tensor dim: [mesh dims]}} or "
                        f"((tensor dim, (mesh dims...)), ...), got {order!r}") from None
    out: dict[int, tuple[int, ...]] = {}
    for d, js in entries:
        if d in out:
            raise ValueError(f"shard order {order!r} lists tensor dim {d} twice")
        out[d] = js
    return out


def resolve_spec(what: str, value: Any, order: Any, mesh_ndim: int, ndim: int) -> tuple[tuple[Placement, ...], ShardOrder]:
    """Placements (sequence or text) + order (None, text, dict, pairs) -> validated (placements, order).

    Entries of the order replace the default (left-to-right) entries of their tensor dims only.
    """
    marked: dict[int, tuple[int, ...]] = {}
    if isinstance(value, str):
        value, marked = parse_spec(value, mesh_ndim)
    elif isinstance(value, Sequence) and not isinstance(value, Placement):
        value = tuple(parse_placements(p, 1)[0] if isinstance(p, str) else p for p in value)
    try:
        pl = normalize_placements(value, ndim, mesh_ndim)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{what}: {e}") from None
    def wrap(d):
        return d + ndim if isinstance(d, int) and not isinstance(d, bool) and d < 0 else d

    given = {wrap(d): js for d, js in _order_entries(order).items()}
    marked = {wrap(d): js for d, js in marked.items()}
    for d, js in marked.items():
        if d in given and tuple(given[d]) != js:
            raise ValueError(f"{what}: shard order {order!r} contradicts the positions in the placements "
                             f"for tensor dim {d}: {js}")
    entries = dict(default_shard_order(pl))
    entries.update(marked)
    entries.update(given)
    try:
        return pl, validate_shard_order(pl, tuple(entries.items()))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{what}: {e}") from None


# -- formatting ---------------------------------------------------------------------------------

def _num(x: float) -> str:
    s = f"{x:.2f}".rstrip("0").rstrip(".")
    return s or "0"


def format_bytes(b: float) -> str:
    """``96`` -> ``96 B``, ``24576`` -> ``24 KiB``, ``1536`` -> ``1.5 KiB`` (2 decimals at most)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{_num(b / scale)} {unit}"
    return f"{_num(b)} B"


def format_time(t: float) -> str:
    if t == 0:
        return "0"
    if t < 1e-3:
        return f"{_num(t * 1e6)} us"
    if t < 1:
        return f"{_num(t * 1e3)} ms"
    return f"{_num(t)} s"


def _jnum(x: Fraction | float) -> int | float:
    """An exact count as an int when whole, else a float (JSON)."""
    if isinstance(x, Fraction):
        return int(x) if x.denominator == 1 else float(x)
    return int(x) if float(x).is_integer() else float(x)


def _pl_str(pl: Sequence[Placement]) -> list[str]:
    return [str(p) for p in pl]


def _order_json(order: ShardOrder) -> list:
    return [[d, list(js)] for d, js in order]


def _order_from_json(obj) -> ShardOrder:
    return tuple((int(d), tuple(int(j) for j in js)) for d, js in obj)
