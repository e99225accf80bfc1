"""Explain a redistribution without running it: the steps, their bytes, and a lower bound.

``explain_redistribute(mesh_shape, shape, src, dst)`` plans the change from ``src`` to ``dst``
placements with the executor's planner (``planner.py``) and prices every step with the alpha-beta
model of ``cost.py`` (docs/redistribution.md).  Nothing runs: no processes, no mesh, no data; the
answer depends only on the mesh shape, the global shape, the dtype, the two specs (placements
and shard orders) and the link model.  With ``links=None`` the steps are exactly those
``DTensor.redistribute`` runs.

The result, an :class:`Explanation`, lists each step (mesh dim, state before and after in the
display form of docs/placements.md, collective, bytes sent per rank, group size, modeled time), the
totals, and a **lower bound** on the bytes per rank that any plan over the same edges needs:

* Steps on different mesh dims are different steps, so per-mesh-dim lower bounds add up.
* A mesh dim whose placement is the same in source and target (possibly in another shard
  order), ``R -> anything`` (chunk, partition) and ``P(sum) <-> P(avg)`` (rescale) count 0.
* Any other mesh dim ``j`` must run at least one collective: ``S(a) -> R`` or ``S -> P`` an
  all-gather (the only way out of a shard into a non-shard), ``S(a) -> S(b)`` an all-to-all or
  an all-gather, ``P -> S(b)`` a reduce-scatter or an all-reduce; ``P -> R`` and ``P(op1) ->
  P(op2)`` (other kinds) an all-reduce, or a reduce-scatter followed later by an all-gather.
* Each of those is priced on the smallest tensor it could act on: the global tensor split by
  every *other* mesh dim, without padding, ``|X|min = itemsize * numel / prod(k_i, i != j)``.
  A step's logical shape is the global shape with some other mesh dims' splits applied, with
  ceilings (padding only enlarges), so ``|X| >= |X|min``; and every collective sends at least
  its unpadded share of ``|X|``: all-gather and reduce-scatter ``(k-1)/k``,
  all-to-all ``(k-1)/k^2``, all-reduce (and reduce-scatter + all-gather) ``2(k-1)/k``.

So ``lower_bound_bytes <= total_bytes`` for every plan (a test checks it on
random pairs).  The time bound adds each such mesh dim's fewest latency terms (``k-1``, or
``2(k-1)`` for the reductions to ``R``).  The bound is reached by single-collective changes of
a fully split tensor, e.g. ``S(0) -> R`` on a 1-D mesh; it ignores the shard order entirely.
"""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Mapping, Sequence

import torch

from ..placement import Placement, ShardOrder, all_planned, display
from .cost import LinkModel, logical_shape, normalize_links, step_comm, step_link
from .drawing import draw_plan
from .explain_move import MoveExplanation, explain_move
from .exchange import exchange_dims, exchange_loads
from .moves import bound_fraction, move
from .planner import plan
from .spec_text import (_jnum, int_tuple, _order_from_json, _order_json, _pl_str, format_bytes, format_time, parse_dtype,
                        parse_placements, parse_shard_order, parse_spec, resolve_spec)
from .steps import ExchangeStep, FlatStep, Step

__all__ = ["explain_redistribute", "Explanation", "ExplainedStep", "BoundTerm", "parse_placements", "parse_spec",
           "parse_shard_order", "parse_dtype", "format_bytes", "format_time"]



# -- the explanation ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ExplainedStep:
    """One step: mesh dim ``mesh_dim`` (``group_size`` ranks per group) goes ``src -> dst``."""

    index: int                              # 1-based
    mesh_dim: int
    group_size: int
    src: Placement
    dst: Placement
    placements_before: tuple[Placement, ...]
    order_before: ShardOrder
    placements_after: tuple[Placement, ...]
    order_after: ShardOrder
    collective: str                         # all_gather, all_to_all, reduce_scatter, all_reduce, chunk, ...
    logical_shape: tuple[int, ...]          # the (coordinate-0, padded) tensor the group works on
    bytes: float                            # sent per rank (= received)
    latency_terms: int
    time: float                             # modeled seconds: launch + latency_terms * alpha + bytes * beta
    mesh_dims: tuple[int, ...] = ()         # a flattened group's mesh dims, major first (else empty)

    @property
    def dims_label(self) -> str:
        """``"1"`` for one mesh dim, ``"0+1"`` for the flattened group of mesh dims 0 and 1."""
        return "+".join(map(str, self.mesh_dims)) if self.mesh_dims else str(self.mesh_dim)

    @property
    def before(self) -> str:
        return display(self.placements_before, self.order_before)

    @property
    def after(self) -> str:
        return display(self.placements_after, self.order_after)

    @property
    def transition(self) -> str:
        return f"{self.before} -> {self.after}"

    def to_dict(self) -> dict:
        return {"index": self.index, "mesh_dim": self.mesh_dim, "mesh_dims": list(self.mesh_dims or (self.mesh_dim,)),
                "group_size": self.group_size,
                "src": str(self.src), "dst": str(self.dst), "before": self.before, "after": self.after,
                "placements_before": _pl_str(self.placements_before), "order_before": _order_json(self.order_before),
                "placements_after": _pl_str(self.placements_after), "order_after": _order_json(self.order_after),
                "collective": self.collective, "logical_shape": list(self.logical_shape),
                "bytes_per_rank": _jnum(self.bytes), "latency_terms": self.latency_terms, "time_s": self.time}

    @staticmethod
    def from_dict(d: Mapping) -> "ExplainedStep":
        m = len(d["placements_before"])
        return ExplainedStep(int(d["index"]), int(d["mesh_dim"]), int(d["group_size"]), parse_placements(d["src"], 1)[0],
                             parse_placements(d["dst"], 1)[0], parse_placements(",".join(d["placements_before"]), m),
                             _order_from_json(d["order_before"]), parse_placements(",".join(d["placements_after"]), m),
                             _order_from_json(d["order_after"]), str(d["collective"]), tuple(d["logical_shape"]),
                             d["bytes_per_rank"], int(d["latency_terms"]), d["time_s"],
                             tuple(d["mesh_dims"]) if len(d.get("mesh_dims", ())) > 1 else ())


@dataclass(frozen=True)
class BoundTerm:
    """Lower-bound share of one mesh dim: the cheapest collective(s) that can change it."""

    mesh_dim: int
    src: Placement
    dst: Placement
    collective: str          # "" when the mesh dim needs no communication
    bytes: float | Fraction
    latency_terms: int
    reason: str

    def to_dict(self) -> dict:
        return {"mesh_dim": self.mesh_dim, "src": str(self.src), "dst": str(self.dst), "collective": self.collective,
                "bytes_per_rank": _jnum(self.bytes), "latency_terms": self.latency_terms, "reason": self.reason}

    @staticmethod
    def from_dict(d: Mapping) -> "BoundTerm":
        return BoundTerm(int(d["mesh_dim"]), parse_placements(d["src"], 1)[0], parse_placements(d["dst"], 1)[0],
                         str(d["collective"]), d["bytes_per_rank"], int(d["latency_terms"]), str(d["reason"]))


BOUND_RULE = ("each mesh dim whose placement must change needs at least the cheapest collective that can change it, "
              "priced on the smallest tensor it could act on (the global tensor split by every other mesh dim, "
              "unpadded); steps on different mesh dims are different steps, so these add up; mesh dims that differ "
              "only in shard order, R -> S/P and P(sum) <-> P(avg) count 0; where one all-to-all over several mesh "
              "dims can do the whole change (no partials on them), the bound is at most the most any rank misses of "
              "its target block")


@dataclass(frozen=True)
class Explanation:
    """What a redistribution does and costs (per rank), from specs only.  ``str()`` is ``to_text()``."""

    mesh_shape: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    src_placements: tuple[Placement, ...]
    src_order: ShardOrder
    dst_placements: tuple[Placement, ...]
    dst_order: ShardOrder
    links: tuple[LinkModel, ...]
    steps: tuple[ExplainedStep, ...]
    total_bytes: float
    total_time: float
    lower_bound_bytes: float
    lower_bound_time: float
    bound_terms: tuple[BoundTerm, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def src(self) -> str:
        return display(self.src_placements, self.src_order)

    @property
    def dst(self) -> str:
        return display(self.dst_placements, self.dst_order)

    @property
    def plan_steps(self) -> tuple[Step, ...]:
        """The planner's ``Step`` tuples (runnable with ``execute.apply_step``)."""
        out: list[Step] = []
        for s in self.steps:
            if s.collective == "all_to_all" and len(s.mesh_dims) > 1:
                out.append(ExchangeStep(s.mesh_dim, s.src, s.dst, s.placements_before, s.order_before, dims=s.mesh_dims,
                                        target=s.placements_after, target_order=s.order_after))
            elif s.mesh_dims:
                out.append(FlatStep(s.mesh_dim, s.src, s.dst, s.placements_before, s.order_before, dims=s.mesh_dims))
            else:
                out.append(Step(s.mesh_dim, s.src, s.dst, s.placements_before, s.order_before))
        return tuple(out)

    # -- text ---------------------------------------------------------------------------------
    def to_text(self) -> str:
        head = f"redistribute {self.shape} {self.dtype} on mesh {self.mesh_shape}: {self.src} -> {self.dst}"
        lines = [head]
        if not self.steps:
            lines.append("no steps: source and target are the same spec")
        else:
            rows = [("#", "mesh dim", "k", "transition", "collective", "logical shape", "bytes/rank", "time")]
            for s in self.steps:
                rows.append((str(s.index), s.dims_label, str(s.group_size), s.transition,
                             s.collective if s.collective != "identity" else "-", str(s.logical_shape),
                             format_bytes(s.bytes), format_time(s.time)))
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            right = {0, 2, 6, 7}
            for r in rows:
                cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
                lines.append("  ".join(cells).rstrip())
        lines.append(f"total: {format_bytes(self.total_bytes)} per rank ({_jnum(self.total_bytes)} bytes), "
                     f"modeled {format_time(self.total_time)}")
        lines.append(f"lower bound: {format_bytes(self.lower_bound_bytes)} per rank "
                     f"({_jnum(self.lower_bound_bytes)} bytes), {format_time(self.lower_bound_time)}"
                     + ("  -- the plan meets it" if self.total_bytes <= self.lower_bound_bytes else ""))
        for t in self.bound_terms:
            if t.collective:
                lines.append(f"  mesh dim {t.mesh_dim}: {t.reason}")
        if not any(t.collective for t in self.bound_terms):
            lines.append("  no mesh dim needs communication by itself" if self.steps else "  nothing to change")
        lines.extend(textwrap.wrap(f"(why a bound: {BOUND_RULE})", 100, initial_indent="  ", subsequent_indent="   "))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-able (``json.dumps`` works as is); ``Explanation.from_dict`` reverses it."""
        return {
            "mesh_shape": list(self.mesh_shape), "shape": list(self.shape), "dtype": self.dtype,
            "itemsize": self.itemsize,
            "src": {"display": self.src, "placements": _pl_str(self.src_placements), "order": _order_json(self.src_order)},
            "dst": {"display": self.dst, "placements": _pl_str(self.dst_placements), "order": _order_json(self.dst_order)},
            "links": [{"alpha": lk.alpha, "beta": lk.beta, "launch": lk.launch} for lk in self.links],
            "steps": [s.to_dict() for s in self.steps],
            "total_bytes_per_rank": _jnum(self.total_bytes), "total_time_s": self.total_time,
            "lower_bound": {"bytes_per_rank": _jnum(self.lower_bound_bytes), "time_s": self.lower_bound_time,
                            "rule": BOUND_RULE, "terms": [t.to_dict() for t in self.bound_terms]},
            "notes": list(self.notes),
        }

    @staticmethod
    def from_dict(d: Mapping) -> "Explanation":
        m = len(d["mesh_shape"])
        lb = d["lower_bound"]
        return Explanation(
            tuple(d["mesh_shape"]), tuple(d["shape"]), str(d["dtype"]), int(d["itemsize"]),
            parse_placements(",".join(d["src"]["placements"]), m), _order_from_json(d["src"]["order"]),
            parse_placements(",".join(d["dst"]["placements"]), m), _order_from_json(d["dst"]["order"]),
            tuple(LinkModel(x["alpha"], x["beta"], x.get("launch", LinkModel.launch)) for x in d["links"]),
            tuple(ExplainedStep.from_dict(s) for s in d["steps"]), d["total_bytes_per_rank"], d["total_time_s"],
            lb["bytes_per_rank"], lb["time_s"], tuple(BoundTerm.from_dict(t) for t in lb["terms"]),
            tuple(d.get("notes", ())))

    # -- picture ------------------------------------------------------------------------------
    def draw(self, png_path: str, dpi: int = 100) -> str:
        """Write a PNG: one row per step, the layout before and after it, the collective and bytes
        on the arrow.  1-D/2-D tensors are drawn as blocks labelled with the ranks holding them
        (rank = row-major index of the mesh coordinate); higher ranks get a per-dim description.
        Uses matplotlib's Agg canvas only (no pyplot state).  Returns ``png_path``."""
        draw_plan(self, png_path, dpi)
        return png_path


# -- the lower bound ----------------------------------------------------------------------------

def _bound_term(j: int, a: Placement, b: Placement, mesh_shape, numel: int, itemsize: int) -> BoundTerm:
    k = mesh_shape[j]
    rest = math.prod(mesh_shape) // k
    xmin = Fraction(numel * itemsize, rest)
    x_txt = (f"|X|min = {format_bytes(numel * itemsize)} / {rest}, split by the other mesh dims" if rest > 1
             else "|X|min = the whole tensor")
    m = move(a, b, k)
    if not m.hops:
        why = ("same placement" if a == b else "a group of one rank" if k == 1
               else f"local {m.collective}")
        return BoundTerm(j, a, b, "", 0, 0, f"{a} -> {b}: {why}, no communication")
    frac = bound_fraction(m, k)
    ftxt = ("2" if m.hops == 2 else "") + ("(k-1)/k" if len(m.split) < 2 else "(k-1)/k^2")
    byt = frac * xmin
    val = str(frac.numerator) if frac.denominator == 1 else f"{frac.numerator}/{frac.denominator}"
    return BoundTerm(j, a, b, m.collective, byt, m.hops * (k - 1),
                     f"{a} -> {b} (k={k}) needs {m.how}: >= {ftxt} x |X|min "
                     f"= {val} x {format_bytes(float(xmin))} = {format_bytes(float(byt))} ({x_txt})")


# -- the main call ------------------------------------------------------------------------------

def _after(step: Step) -> tuple[tuple[Placement, ...], ShardOrder]:
    if isinstance(step, ExchangeStep):
        return step.target, step.target_order
    pl = list(step.placements)
    order = {d: list(js) for d, js in step.order}
    for j in step.mesh_dims:
        pl[j] = step.dst
        a, b = step.src.tensor_dim(), step.dst.tensor_dim()
        if a is not None:
            order[a].remove(j)
        if b is not None:
            order.setdefault(b, []).append(j)
    return tuple(pl), tuple((d, tuple(js)) for d, js in sorted(order.items()) if js)


def explain_redistribute(mesh_shape: Sequence[int], shape: Sequence[int], src, dst, dtype: Any = torch.float32,
                         src_order=None, dst_order=None, links=None, *, dst_mesh: Sequence[int] | None = None,
                         src_ranks: Sequence[int] | None = None, dst_ranks: Sequence[int] | None = None
                         ) -> Explanation | MoveExplanation:
    """Plan and price the redistribution of a ``shape`` tensor on a ``mesh_shape`` mesh.

    ``src``/``dst``: placements (``[Shard(0), Replicate()]``) or text (``"S0,R"``, ``"P(max),S1"``,
    ``"S(0)[1],S(0)[0]"``; see :func:`parse_spec`).  ``src_order``/``dst_order``: shard order
    entries replacing the default ones of their tensor dims: ``"0:1,0"``, ``{0: [1, 0]}`` or
    ``((0, (1, 0)),)``.  ``dtype``: a torch dtype or a name (``"bf16"``).  ``links``: a
    ``LinkModel`` or one per mesh dim (default: ``DEFAULT_LINK``; the executor plans with the
    default).  The steps are those ``redistribute`` runs (with the default links).
    Raises ``ValueError``/``TypeError`` with a message on bad input.  No processes or data.

    ``dst_mesh`` (a mesh shape; with ``src_ranks``/``dst_ranks``, default ``0..n-1``) explains a
    move to another mesh instead: a ``MoveExplanation`` of its point-to-point transfers; so is a
    redistribution to or from a placement the planner does not move (``StridedShard``,
    ``RaggedShard``: one exchange of blocks).
    """
    if dst_mesh is not None or src_ranks is not None or dst_ranks is not None:
        return explain_move(mesh_shape, shape, src, mesh_shape if dst_mesh is None else dst_mesh, dst,
                            src_ranks=src_ranks, dst_ranks=dst_ranks, dtype=dtype, src_order=src_order,
                            dst_order=dst_order)
    mesh_shape = int_tuple("mesh shape", mesh_shape, 1)
    if not mesh_shape:
        raise ValueError("mesh shape must have at least one dim")
    shape = int_tuple("tensor shape", shape, 0)
    dt = parse_dtype(dtype)
    itemsize = dt.itemsize
    m, n = len(mesh_shape), len(shape)
    src_pl, s_order = resolve_spec("source", src, src_order, m, n)
    dst_pl, d_order = resolve_spec("target", dst, dst_order, m, n)
    if not (all_planned(src_pl) and all_planned(dst_pl)):  # an exchange of blocks, as redistribute runs it
        return explain_move(mesh_shape, shape, src_pl, mesh_shape, dst_pl, dtype=dt, src_order=s_order,
                            dst_order=d_order)
    lk = normalize_links(links, m)
    steps = plan(src_pl, s_order, dst_pl, d_order, shape, mesh_shape, itemsize, None if links is None else lk)

    out: list[ExplainedStep] = []
    total = Fraction(0)
    total_time = 0.0
    for i, st in enumerate(steps, 1):
        kind, num, den, lat = step_comm(st, shape, mesh_shape)
        b = Fraction(num * itemsize, den)
        link = step_link(st, lk)
        t = (link.launch + lat * link.alpha + link.beta * float(b)) if lat else 0.0
        total += b
        total_time += t
        pl_after, order_after = _after(st)
        dims = st.mesh_dims
        out.append(ExplainedStep(i, st.mesh_dim, math.prod(mesh_shape[j] for j in dims), st.src, st.dst, st.placements,
                                 st.order, pl_after, order_after, kind, logical_shape(st, shape, mesh_shape),
                                 _jnum(b), lat, t, dims if len(dims) > 1 else ()))

    numel = math.prod(shape)
    terms = tuple(_bound_term(j, a, b, mesh_shape, numel, itemsize) for j, (a, b) in enumerate(zip(src_pl, dst_pl)))
    lb = sum((Fraction(t.bytes) for t in terms), Fraction(0))
    lb_time = sum(t.latency_terms * lk[t.mesh_dim].alpha + lk[t.mesh_dim].beta * float(t.bytes) for t in terms)
    if any(t.collective for t in terms):
        lb_time += min(lk[t.mesh_dim].launch for t in terms if t.collective)  # at least one collective
    xdims = exchange_dims(src_pl, s_order, dst_pl, d_order, mesh_shape)
    if xdims is not None:
        # one exchange over several mesh dims is not a sum of per-dim steps: the bound is then
        # also at most what some rank misses of its target block (it must receive that much)
        missing = Fraction(exchange_loads(shape, mesh_shape, xdims, src_pl, s_order, dst_pl, d_order)[1] * itemsize)
        if missing < lb:
            lb = missing
            lb_time = min(lb_time, min(lk[j].launch for j in xdims) + min(lk[j].beta for j in xdims) * float(missing))
    terms = tuple(BoundTerm(t.mesh_dim, t.src, t.dst, t.collective, _jnum(Fraction(t.bytes)), t.latency_terms, t.reason)
                  for t in terms)

    notes = []
    for j, (pa, pb) in enumerate(zip(src_pl, dst_pl)):
        if not move(pa, pb, mesh_shape[j]).forward:
            notes.append(f"mesh dim {j}: {pa} -> {pb} is refused by DTensor.redistribute in the forward pass"
                         "; the plan is what the planner returns")
    if links is not None:
        notes.append("links given: the executor plans with the default links, so its steps may differ")
    return Explanation(mesh_shape, shape, str(dt).removeprefix("torch."), itemsize, src_pl, s_order, dst_pl,
                       d_order, lk, tuple(out), _jnum(total), total_time, _jnum(lb), lb_time, terms, tuple(notes))
