"""Draw which ranks hold which block of a DTensor.

Everything is computed from the spec (global shape, mesh, placements, shard order) with
``local_shape_and_offset`` for every mesh coordinate: no communication, so a drawing can be
made inside one rank of SPMD code.  1-D and 2-D tensors are drawn as a grid whose column
widths and row heights follow the block sizes (with a minimum that fits the labels); tensors
of 3 or more dims get a per-dim description.  ASCII by default, colours with ``rich``, and a
matplotlib PNG on request.
"""
from __future__ import annotations

import io
import itertools
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from ..placement import display, local_blocks, local_shape_and_offset
from ..redistribute.drawing import PALETTE, ranks_label

__all__ = ["visualize_sharding", "describe_sharding", "Piece", "pieces"]

GRID_WIDTH = 48      # target interior width of a grid, in characters
GRID_HEIGHT = 8      # target interior height of a 2-D grid, in lines (at most one per tensor row)


@dataclass(frozen=True)
class Piece:
    """One rank's piece: its mesh coordinate, local shape and global offset."""

    rank: int
    coordinate: tuple[int, ...]
    shape: tuple[int, ...]
    offset: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return any(s == 0 for s in self.shape)


def _spec_of(x: Any):
    spec = getattr(x, "_spec", None)
    if spec is None and hasattr(x, "placements") and hasattr(x, "mesh") and hasattr(x, "shape"):
        spec = x  # a DTensorSpec
    if spec is None:
        raise TypeError(f"visualize_sharding needs a DTensor (or DTensorSpec), got {type(x).__name__}")
    return spec


def pieces(x: Any) -> list[Piece]:
    """Every rank's piece of a DTensor or DTensorSpec, in rank order (no communication)."""
    spec = _spec_of(x)
    mesh = spec.mesh
    shape = tuple(spec.shape)
    out: list[Piece] = []
    for coord in itertools.product(*(range(k) for k in mesh.shape)):
        rank = int(mesh.mesh[coord])
        blocks = local_blocks(shape, mesh.shape, coord, spec.placements, spec.shard_order)
        if len(blocks) > 1:  # a packed layout: a piece per block
            out.extend(Piece(rank, tuple(coord), s, o) for s, o, _ in blocks)
            continue
        s, o = local_shape_and_offset(shape, mesh.shape, coord, spec.placements, spec.shard_order)
        out.append(Piece(rank, tuple(coord), tuple(s), tuple(o)))
    return sorted(out, key=lambda p: p.rank)


# -- text pieces ------------------------------------------------------------------------------

def _mesh_dim_name(mesh, j: int) -> str:
    names = mesh.mesh_dim_names
    return f"mesh dim {j} ({names[j]})" if names else f"mesh dim {j}"


def _title(spec, header: str) -> list[str]:
    mesh = spec.mesh
    names = f" [{', '.join(mesh.mesh_dim_names)}]" if mesh.mesh_dim_names else ""
    dtype = str(spec.dtype).replace("torch.", "")
    line = (f"DTensor {tuple(spec.shape)} {dtype} on mesh {tuple(mesh.shape)}{names}: "
            f"{display(spec.placements, spec.shard_order)}")
    return ([header] if header else []) + [line]


_OP_WORD = {"sum": "sum", "avg": "average", "max": "max", "min": "min", "product": "product"}


def _notes(spec, ps: list[Piece], replicate_notes: bool = False) -> list[str]:
    out = []
    for j, p in enumerate(spec.placements):
        if p.is_partial():
            out.append(f"{p} over {_mesh_dim_name(spec.mesh, j)}: ranks hold terms; "
                       f"value = {_OP_WORD[p.reduce_op]} over mesh dim {j}")
        elif replicate_notes and p.is_replicate():
            out.append(f"R over {_mesh_dim_name(spec.mesh, j)}: ranks hold copies")
    empty: dict[tuple[int, ...], list[int]] = {}
    for pc in ps:
        if pc.empty:
            empty.setdefault(pc.shape, []).append(pc.rank)
    if empty:
        items = [f"{ranks_label(rs)} {shape}" for shape, rs in sorted(empty.items(), key=lambda kv: min(kv[1]))]
        out.append("empty pieces: " + "; ".join(items))
    return out


# -- the grid ---------------------------------------------------------------------------------

def _round(x: float) -> int:
    return int(x + 0.5)


def _scaled(sizes: Sequence[int], target: int, minimum: Sequence[int]) -> list[int]:
    total = sum(sizes) or 1
    return [max(m, _round(target * s / total)) for s, m in zip(sizes, minimum)]


@dataclass
class _Grid:
    rows: list[tuple[int, int]]                    # (offset, size) of each row block
    cols: list[tuple[int, int]]                    # (offset, size) of each column block
    cells: dict[tuple[int, int], list[int]]        # (row index, col index) -> ranks


def _grid(spec, ps: list[Piece]) -> _Grid:
    nd = len(spec.shape)
    full = [p for p in ps if not p.empty]
    if nd == 1:
        rows = [(0, 1)]
        cols = sorted({(p.offset[0], p.shape[0]) for p in full})
    else:
        rows = sorted({(p.offset[0], p.shape[0]) for p in full})
        cols = sorted({(p.offset[1], p.shape[1]) for p in full})
    cells: dict[tuple[int, int], list[int]] = {}
    for p in full:
        r = 0 if nd == 1 else rows.index((p.offset[0], p.shape[0]))
        c = cols.index((p.offset[nd - 1], p.shape[nd - 1]))
        cells.setdefault((r, c), []).append(p.rank)
    return _Grid(rows, cols, cells)


def _cell_label(ranks: list[int], partial: bool) -> str:
    return ("P " if partial else "") + ranks_label(ranks)


def _iv(off: int, size: int) -> str:
    return f"{off}:{off + size}"


def _draw(spec, g: _Grid) -> tuple[list[str], list[list[int | None]]]:
    """ASCII lines of the grid and, per character, the cell index it belongs to (for colour)."""
    nd = len(spec.shape)
    partial = any(p.is_partial() for p in spec.placements)
    labels = {rc: _cell_label(rs, partial) for rc, rs in g.cells.items()}
    nr, nc = len(g.rows), len(g.cols)
    col_heads = [_iv(*c) for c in g.cols]
    need_w = [max([len(labels.get((r, c), "")) for r in range(nr)] + [len(col_heads[c]) - 1]) + 2 for c in range(nc)]
    widths = _scaled([s for _, s in g.cols], GRID_WIDTH, need_w)
    if nd == 1:
        heights = [1]
        row_heads: list[str] = []
        lw = 0
    else:
        target = min(sum(s for _, s in g.rows), max(GRID_HEIGHT, nr))
        heights = _scaled([s for _, s in g.rows], target, [1] * nr)
        row_heads = [_iv(*r) for r in g.rows]
        lw = max(len(h) for h in row_heads) + 1

    lines: list[str] = []
    owner: list[list[int | None]] = []

    def add(text: str, own: list[int | None] | None = None) -> None:
        lines.append(text)
        owner.append(own if own is not None else [None] * len(text))

    head = " " * lw
    for c in range(nc):
        head += " " + col_heads[c].center(widths[c])
    add(head.rstrip())
    border = " " * lw + "+" + "+".join("-" * w for w in widths) + "+"
    add(border)
    for r in range(nr):
        mid = (heights[r] - 1) // 2
        for i in range(heights[r]):
            text = (row_heads[r].rjust(lw - 1) + " ") if (nd > 1 and i == mid) else " " * lw
            own: list[int | None] = [None] * lw
            text += "|"
            own.append(None)
            for c in range(nc):
                lab = labels.get((r, c), "") if i == mid else ""
                text += lab.center(widths[c]) + "|"
                own.extend([r * nc + c] * widths[c] + [None])
            add(text, own)
        add(border)
    return lines, owner


def _render_rich(lines: list[str], owner: list[list[int | None]]) -> str:
    from rich.console import Console
    from rich.text import Text

    text = Text()
    for k, (line, own) in enumerate(zip(lines, owner)):
        if k:
            text.append("\n")
        for key, grp in itertools.groupby(range(len(line)), key=lambda i: own[i] if i < len(own) else None):
            idx = list(grp)
            seg = line[idx[0]:idx[-1] + 1]
            style = f"black on {PALETTE[key % len(PALETTE)]}" if key is not None else None
            text.append(seg, style=style)
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, color_system="truecolor", width=max(len(x) for x in lines) + 1,
                      soft_wrap=True, highlight=False)
    console.print(text)
    return buf.getvalue().rstrip("\n")


def _png(spec, g: _Grid | None, title: list[str], notes: list[str], path: str) -> None:
    """The same grid as a matplotlib picture, blocks at their true proportions (Agg, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    nd = len(spec.shape)
    grid = g is not None and bool(g.cells)
    height = (2.2 if nd == 1 else 5.0) if grid else 1.2 + 0.25 * (nd + len(notes))
    fig = Figure(figsize=(7, height + 0.2 * len(notes)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title("\n".join(title), fontsize=10)
    if not grid:
        ax.axis("off")
        body = _dims_description(spec) if nd > 2 else ["(no elements)"]
        ax.text(0, 1, "\n".join([b.strip() for b in body] + notes), va="top", family="monospace", fontsize=9,
                transform=ax.transAxes)
    else:
        assert g is not None
        partial = any(p.is_partial() for p in spec.placements)
        ncols = len(g.cols)
        for (r, c), ranks in sorted(g.cells.items()):
            x0, w = g.cols[c]
            y0, h = (0, 1) if nd == 1 else g.rows[r]
            ax.add_patch(Rectangle((x0, y0), w, h, facecolor=PALETTE[(r * ncols + c) % len(PALETTE)],
                                   edgecolor="black", linewidth=1))
            ax.text(x0 + w / 2, y0 + h / 2, _cell_label(ranks, partial), ha="center", va="center", fontsize=9)
        width = spec.shape[nd - 1]
        rows = 1 if nd == 1 else spec.shape[0]
        ax.set_xlim(0, width)
        ax.set_ylim(rows, 0)
        ax.set_xticks(sorted({o for o, _ in g.cols} | {width}))
        ax.xaxis.tick_top()
        ax.set_xlabel("\n".join([f"dim {nd - 1}"] + notes), fontsize=9)
        if nd == 1:
            ax.set_yticks([])
        else:
            ax.set_yticks(sorted({o for o, _ in g.rows} | {rows}))
            ax.set_ylabel("dim 0")
    fig.savefig(path, format="png")


# -- 3+ dims ----------------------------------------------------------------------------------

def _dims_description(spec) -> list[str]:
    mesh = spec.mesh
    order = dict(spec.shard_order)
    out = []
    for d, n in enumerate(spec.shape):
        js = list(order.get(d, ()))
        if not js:
            out.append(f"  dim {d} ({n}): not split")
            continue
        # piece sizes in offset order: coordinates of the splitting mesh dims, first-applied major
        sizes = []
        for sub in itertools.product(*(range(mesh.shape[j]) for j in js)):
            coord = [0] * mesh.ndim
            for j, c in zip(js, sub):
                coord[j] = c
            s, _ = local_shape_and_offset(spec.shape, mesh.shape, coord, spec.placements, spec.shard_order)
            sizes.append(s[d])
        by = " then ".join(f"{_mesh_dim_name(mesh, j)} x{mesh.shape[j]}" for j in js)
        out.append(f"  dim {d} ({n}): split by {by}: pieces {','.join(map(str, sizes))}")
    return out


# -- public -----------------------------------------------------------------------------------

def describe_sharding(x: Any, header: str = "", use_rich: bool = False) -> str:
    """The text ``visualize_sharding`` prints, without printing it."""
    spec = _spec_of(x)
    return _build(spec, header, use_rich)[0]


def _build(spec, header: str, use_rich: bool) -> tuple[str, _Grid | None, list[str], list[str]]:
    ps = pieces(spec)
    title = _title(spec, header)
    nd = len(spec.shape)
    if nd in (1, 2):
        notes = _notes(spec, ps)
        g = _grid(spec, ps)
        if not g.cells:
            body = ["(no elements)"]
            text = "\n".join(title + body + notes)
            return text, g, title, notes
        lines, owner = _draw(spec, g)
        grid = _render_rich(lines, owner) if use_rich else "\n".join(lines)
        return "\n".join(title + [grid] + notes), g, title, notes
    notes = _notes(spec, ps, replicate_notes=True)
    body = _dims_description(spec) if nd else ["  scalar: every rank holds the whole value"]
    return "\n".join(title + body + notes), None, title, notes


def visualize_sharding(dtensor: Any, use_rich: bool | None = None, png: str | None = None, header: str = "") -> str:
    """Draw which ranks hold which block of ``dtensor``; print it once per mesh; return it.

    1-D and 2-D tensors: a grid, column widths and row heights proportional to the block
    sizes (at least wide enough for the labels), each cell labelled with the ranks holding
    it (``r0-r3``: ranks 0 to 3; ``P r0,r2``: ranks holding terms of a Partial value).
    Empty pieces and Partial placements are listed under the grid.  3+ dims: per tensor dim,
    which mesh dims split it, in which order, and the piece sizes.

    ``use_rich``: colour with rich (``None``: when stdout is a terminal).  ``png``: also write
    a matplotlib picture of the grid there.  Only the mesh's first rank prints and writes the
    PNG (one copy, not one per simulated rank); every rank gets the string.  No communication.
    """
    spec = _spec_of(dtensor)
    if use_rich is None:
        use_rich = bool(getattr(sys.stdout, "isatty", lambda: False)())
    text, g, title, notes = _build(spec, header, bool(use_rich))
    mesh = spec.mesh
    first = int(mesh.mesh.flatten()[0])
    if mesh.get_rank() == first:
        print(text, flush=True)
        if png is not None:
            _png(spec, g, title, notes, png)
    return text
