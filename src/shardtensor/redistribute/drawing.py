"""Pictures of a redistribution plan (``Explanation.draw``): one row per step, the layout before
and after it, the collective and its bytes on the arrow.  matplotlib's Agg canvas only.

``explain.py`` imports this module and hands it an ``Explanation``, read by its fields here
(typed ``Any``: importing the class back would close an import circle)."""
from __future__ import annotations

import itertools
import math

from typing import Any, Sequence

from ..placement import display, local_shape_and_offset
from .spec_text import format_bytes, format_time

__all__ = ["PALETTE", "draw_plan", "ranks_label"]

PALETTE = ["#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
           "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f"]
"""Block colours, by rank (also the sharding drawings' of ``debug.visualize``)."""


def ranks_label(ranks: Sequence[int]) -> str:
    """``[0]`` -> ``r0``; ``[0, 2]`` -> ``r0,r2``; ``[0, 1, 2, 3]`` -> ``r0-r3``."""
    rs = sorted(set(ranks))
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"r{rs[i]}-r{rs[j]}")
        else:
            parts.extend(f"r{r}" for r in rs[i:j + 1])
        i = j + 1
    return ",".join(parts)


def _state_blocks(shape, mesh_shape, pl, order):
    """((offset, size) per dim) -> ranks holding that block, and the ranks holding empty pieces."""
    blocks: dict[tuple, list[int]] = {}
    empty: list[int] = []
    for rank, coord in enumerate(itertools.product(*(range(k) for k in mesh_shape))):
        s, o = local_shape_and_offset(shape, mesh_shape, coord, pl, order)
        if any(x == 0 for x in s):
            empty.append(rank)
        else:
            blocks.setdefault(tuple(zip(o, s)), []).append(rank)
    return blocks, empty


def _dims_text(shape, mesh_shape, pl, order) -> list[str]:
    if not shape:
        return ["scalar: every rank holds the whole value"]
    lists = dict(order)
    out = []
    for d, size in enumerate(shape):
        js = lists.get(d, ())
        if not js:
            out.append(f"dim {d} ({size}): not split")
            continue
        sizes = []
        for sub in itertools.product(*(range(mesh_shape[j]) for j in js)):
            coord = [0] * len(mesh_shape)
            for j, c in zip(js, sub):
                coord[j] = c
            sizes.append(local_shape_and_offset(shape, mesh_shape, coord, pl, order)[0][d])
        by = " then ".join(f"m{j} x{mesh_shape[j]}" for j in js)
        out.append(f"dim {d} ({size}): split by {by}: {','.join(map(str, sizes))}")
    return out


def _draw_state(ax, ex: Any, pl, order, palette) -> None:
    from matplotlib.patches import Rectangle

    shape, mesh_shape = ex.shape, ex.mesh_shape
    nd = len(shape)
    partial = [j for j, p in enumerate(pl) if p.is_partial()]
    notes = [f"P over m{j}: ranks hold terms" for j in partial]
    ax.set_title(display(pl, order), fontsize=9)
    if nd in (1, 2) and math.prod(shape) > 0:
        blocks, empty = _state_blocks(shape, mesh_shape, pl, order)
        ncell = len(blocks)
        fs = 8 if ncell <= 8 else 6 if ncell <= 32 else 4
        for (key, ranks) in sorted(blocks.items()):
            (r0, rs), (c0, cs) = ((0, 1), key[0]) if nd == 1 else key
            ax.add_patch(Rectangle((c0, r0), cs, rs, facecolor=palette[min(ranks) % len(palette)], edgecolor="black",
                                   linewidth=0.8))
            ax.text(c0 + cs / 2, r0 + rs / 2, ("P " if partial else "") + ranks_label(ranks), ha="center",
                    va="center", fontsize=fs)
        width, rows = shape[-1], (1 if nd == 1 else shape[0])
        ax.set_xlim(0, width)
        ax.set_ylim(rows, 0)
        xt = sorted({k[-1][0] for k in blocks} | {width})
        ax.set_xticks(xt if len(xt) <= 9 else [0, width])
        ax.xaxis.tick_top()
        ax.tick_params(labelsize=7)
        if nd == 1:
            ax.set_yticks([])
        else:
            yt = sorted({k[0][0] for k in blocks} | {rows})
            ax.set_yticks(yt if len(yt) <= 9 else [0, rows])
        if empty:
            notes.append("empty: " + ranks_label(empty))
        ax.set_xlabel("\n".join(notes), fontsize=7)
    else:
        ax.axis("off")
        body = _dims_text(shape, mesh_shape, pl, order) if math.prod(shape) > 0 or nd == 0 else ["(no elements)"]
        ax.text(0.0, 0.9, "\n".join(body + notes), va="top", ha="left", family="monospace", fontsize=7,
                transform=ax.transAxes)


def draw_plan(ex: Any, path: str, dpi: int = 100) -> None:
    """Draw ``ex`` (an ``Explanation``) to a PNG at ``path``: one row per step, the layouts before and after it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    nd = len(ex.shape)
    rows: list[Any] = list(ex.steps) or [None]
    row_h = 1.5 if nd == 1 else 2.4 if nd == 2 else 0.6 + 0.22 * max(nd, 2)
    nranks = math.prod(ex.mesh_shape)
    footer = ""
    if len(ex.mesh_shape) > 1 and nranks <= 16:
        coords = itertools.product(*(range(k) for k in ex.mesh_shape))
        footer = "ranks: " + "  ".join(f"r{r}={tuple(c)}" for r, c in enumerate(coords))
    fig = Figure(figsize=(11, 1.1 + row_h * len(rows) + (0.3 if footer else 0)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(len(rows), 3, width_ratios=[4, 2.4, 4])
    fig.suptitle(f"{ex.shape} {ex.dtype} on mesh {ex.mesh_shape}: {ex.src} -> {ex.dst}\n"
                 f"total {format_bytes(ex.total_bytes)} per rank, {format_time(ex.total_time)};  "
                 f"lower bound {format_bytes(ex.lower_bound_bytes)}", fontsize=10)
    for i, st in enumerate(rows):
        left, mid, right = (fig.add_subplot(gs[i, c]) for c in range(3))
        if st is None:
            _draw_state(left, ex, ex.src_placements, ex.src_order, PALETTE)
            _draw_state(right, ex, ex.dst_placements, ex.dst_order, PALETTE)
            label = "no steps\n(same spec)"
        else:
            _draw_state(left, ex, st.placements_before, st.order_before, PALETTE)
            _draw_state(right, ex, st.placements_after, st.order_after, PALETTE)
            what = ("direct exchange" if st.collective == "all_to_all" and st.mesh_dims else f"{st.src} -> {st.dst}")
            label = (f"step {st.index}: mesh dim {st.dims_label} (k={st.group_size})\n{what}\n"
                     f"{st.collective}\n{format_bytes(st.bytes)} per rank\n{format_time(st.time)}")
        mid.axis("off")
        mid.annotate("", xy=(0.98, 0.5), xytext=(0.02, 0.5), xycoords="axes fraction",
                     arrowprops=dict(arrowstyle="-|>", lw=1.5, color="#444444"))
        mid.text(0.5, 0.56, label, ha="center", va="bottom", fontsize=8, transform=mid.transAxes)
    if footer:
        fig.supxlabel(footer, fontsize=7)
    fig.savefig(path, format="png")
