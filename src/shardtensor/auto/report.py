"""``print(plan)``: the chosen placements per unit with their bytes, time and memory, then the hand plans."""
from __future__ import annotations

from .layout import Layout, Unit
from .measure import Cost
from .model import Blocks
from .solve import Search

__all__ = ["render", "fmt_bytes"]


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _fsdp(layout: Layout, unit: Unit) -> str:
    if unit.shard == "none":
        return "replicated"
    dims = [layout.names[j] for j in layout.batch_dims]
    where = (f"replicate {','.join(dims[:-1])}, shard {dims[-1]}" if unit.shard == "hybrid"
             else f"shard {'x'.join(dims)}")
    return f"{unit.label()} ({where})"


def _tp(layout: Layout, root: bool) -> str:
    if layout.tp is None:
        return ""
    on = layout.names[layout.tp]
    if root:
        return f"; Linears colwise on {on}" if layout.root_tp else f"; replicated on {on}"
    by: dict[str, list[str]] = {}
    for name, style in layout.tp_plan:
        by.setdefault(style, []).append(name)
    return "; TP on " + on + ": " + ", ".join(f"{s} {' '.join(ns)}" for s, ns in sorted(by.items()))


def _row(name: str, what: str, c: Cost) -> list[str]:
    return [name, what, fmt_bytes(c.bytes), f"{c.comm_s * 1e3:.3f}", f"{c.compute_s * 1e3:.3f}", fmt_bytes(c.memory)]


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths)))
    return [line(head), line(["-" * w for w in widths]), *map(line, rows)]


def render(s: Search, blocks: Blocks | None, budget: float | None) -> str:
    """The plan as text: roles, one row per unit, the total, and every hand plan's total."""
    best = s.best
    lay, cost = best.layout, best.cost
    out = [f"autoshard: mesh {lay.roles()}; {s.plans} plans priced in {s.runs} runs, {s.seconds:.2f} s"
           + ("" if budget is None else f"; memory budget {fmt_bytes(budget)} per rank")]
    out += [f"  not considered: {why}" for why in s.skipped]
    head = ["unit", "placements", "bytes/rank", "comm ms", "compute ms", "memory"]
    rows = [_row("root", _fsdp(lay, lay.root) + _tp(lay, True), best.root)]
    if blocks is not None:
        rows.append(_row(f"{blocks.path}.* (each)", _fsdp(lay, lay.blocks) + _tp(lay, False), best.block))
        rows.append(_row(f"{blocks.path}.* (x{best.count})", "", best.block.times(best.count)))
    rows.append(_row("step", "chosen", best.cost))
    out += _table(head, rows)
    out.append("")
    hand_rows = [_row(name, p.layout.roles() + ("" if budget is None or p.cost.memory <= budget
                                                 else "  (over budget)"), p.cost) for name, p in s.hand]
    hand_rows.append(_row("autoshard", lay.roles(), best.cost))
    out += _table(["plan", "roles", "bytes/rank", "comm ms", "compute ms", "memory"], hand_rows)
    out.append(f"predicted step {cost.step_s * 1e3:.3f} ms, {round(cost.bytes):,} B received per rank, "
               f"{fmt_bytes(cost.memory)} per rank")
    return "\n".join(out)
