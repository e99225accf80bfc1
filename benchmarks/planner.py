"""Redistribution planning: shardtensor's optimal planner vs PyTorch DTensor's planners.

    python benchmarks/planner.py [--pairs N] [--graph-pairs N] [--seed S]

For each mesh and tensor rank, random (source, target) pairs are drawn with a fixed seed.
Times are uncached plan times (ours: ``optimal.plan_uncached``, the LRU bypassed; theirs:
``_gen_transform_infos_non_cached``), each the best of a few runs with the GC off, all in this
one process.  Ours is timed twice on every pair: with the native (C) A* search, the default, and
with the Python search (``optimal.NATIVE = False``); both must return the same steps.  The target
of the planner issue is <= 100 us per uncached plan at the worst; the summary says whether the
native search meets it.  Bytes: every plan (theirs too) is priced with shardtensor's alpha-beta
model (``cost.plan_cost``: padded bytes per rank, coordinate-0 logical shapes); ours must never be
more.

PyTorch side (private modules, benchmark only): a ``fake`` process group, its default planner
(greedy for default shard orders) and, on a few pairs per row, its graph (min-cost) planner,
which is much slower.  Sources use default orders for the greedy comparison (so PyTorch takes
its fast path); the graph rows add random nested orders.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shardtensor.placement import Partial, Replicate, Shard, default_shard_order  # noqa: E402
from shardtensor.redistribute import exchange, flatten, optimal  # noqa: E402
from shardtensor.redistribute.cost import normalize_links  # noqa: E402
from shardtensor.redistribute.cost import plan_cost  # noqa: E402
from shardtensor.redistribute.planner import Step  # noqa: E402
from shardtensor.redistribute.planner import plan as simple_plan  # noqa: E402

MESHES = [(4, 4), (2, 2, 4), (4, 4, 4), (2, 2, 2, 2), (2, 2, 4, 4)]
NDIMS = (2, 3, 4)
SIZES = [512, 768, 1000, 1024, 4096, 11008, 12, 7]
SIZE_WEIGHTS = [3, 3, 2, 3, 3, 2, 1, 1]
ITEMSIZE = 4


def _rand_spec(rng, m, ndim, allow_partial, nested_orders):
    pl = []
    for _ in range(m):
        r = rng.random()
        if r < 0.25:
            pl.append(Replicate())
        elif allow_partial and r < 0.40:
            pl.append(Partial(rng.choice(["sum", "max"])))
        else:
            pl.append(Shard(rng.randrange(ndim)))
    order = default_shard_order(pl)
    if nested_orders:
        order = tuple((d, tuple(rng.sample(js, len(js)))) for d, js in order)
    return tuple(pl), order


def _rand_pair(rng, m, ndim, nested_orders):
    src, so = _rand_spec(rng, m, ndim, True, nested_orders)
    dst, do = _rand_spec(rng, m, ndim, False, nested_orders)
    # a Partial target only where the source already holds that Partial (public redistribute rule)
    if rng.random() < 0.3:
        dst = tuple(s if isinstance(s, Partial) and not isinstance(d, Shard) else d for s, d in zip(src, dst))
    return src, so, dst, do


def _best_time(fn, repeats):
    best = float("inf")
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _torch_setup(world):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _torch_mesh(shape):
    from torch.distributed.device_mesh import DeviceMesh

    n = 1
    for k in shape:
        n *= k
    return DeviceMesh("cpu", torch.arange(n).reshape(shape))


def _torch_spec(mesh, pl, order, shape):
    from torch.distributed.tensor import Partial as TP, Replicate as TR, Shard as TS
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta

    tp = []
    for p in pl:
        if isinstance(p, Shard):
            tp.append(TS(p.dim))
        elif isinstance(p, Partial):
            tp.append(TP(p.reduce_op))
        else:
            tp.append(TR())
    stride = []
    acc = 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    meta = TensorMeta(torch.Size(shape), tuple(reversed(stride)), torch.float32)
    so = tuple(ShardOrderEntry(d, tuple(js)) for d, js in order)
    return DTensorSpec(mesh, tuple(tp), tensor_meta=meta, shard_order=so)


def _to_ours(p):
    from torch.distributed.tensor import Partial as TP, Shard as TS

    if isinstance(p, TS):
        return Shard(p.dim)
    if isinstance(p, TP):
        return Partial(p.reduce_op)
    return Replicate()


def _their_steps(infos, src, so):
    """Replay PyTorch's transform infos as our Steps (state before each step) to price them."""
    cur = list(src)
    lists = {d: list(js) for d, js in so}
    steps = []
    for info in infos:
        a, b = (_to_ours(p) for p in info.src_dst_placements)
        j = info.mesh_dim
        order = tuple((d, tuple(js)) for d, js in sorted(lists.items()) if js)
        steps.append(Step(j, a, b, tuple(cur), order))
        if isinstance(a, Shard):
            lists[a.dim].remove(j)
        if isinstance(b, Shard):
            lists.setdefault(b.dim, []).append(j)
        cur[j] = b
    return steps, tuple(cur)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=40, help="random pairs per (mesh, tensor rank)")
    ap.add_argument("--graph-pairs", type=int, default=2, help="pairs per row for PyTorch's graph planner")
    ap.add_argument("--graph-budget", type=float, default=45.0, help="seconds for all graph-planner runs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch.distributed.tensor._redistribute as tr

    _torch_setup(max(_prod(s) for s in MESHES))
    rng = random.Random(args.seed)
    gc.disable()
    t_start = time.perf_counter()
    graph_spent = 0.0
    rows = []
    worse_total = 0
    all_ours, all_theirs = [], []
    per_mesh: dict[tuple, tuple[list, list, list]] = {}
    full_rows: dict = {}
    plan_cost_rows: dict = {}
    slowest = (0.0, None, None, 0)  # (time, mesh, shape, expansions) of our slowest plan
    expansions = []
    caps = 0
    all_py: list[float] = []
    switch = optimal.NATIVE
    native = optimal.native_available() and switch
    print(f"torch {torch.__version__}; {os.cpu_count()} CPUs; best of {args.repeats} runs per plan; "
          f"itemsize {ITEMSIZE}; native search: {'yes' if native else 'NO (not compiled or SHARDTENSOR_PLANNER_NATIVE=0)'}")
    print()
    hdr = (f"{'mesh':>12} {'nd':>2} {'n':>3} | {'ours med':>8} {'ours max':>8} | {'py med':>7} {'py max':>7} | "
           f"{'torch med':>9} {'torch max':>9} | {'med x':>6} {'max x':>6} | "
           f"{'bytes ours/torch':>16} {'<':>3} {'=':>3} {'>':>2}")
    print(f"uncached plan time (us): ours ({'native' if native else 'Python'} search), "
          "ours with the Python search (py), PyTorch default planner (greedy; default shard orders); x = torch / ours")
    print(hdr)
    print("-" * len(hdr))
    for mesh_shape in MESHES:
        tmesh = _torch_mesh(mesh_shape)
        m = len(mesh_shape)
        for ndim in NDIMS:
            ours_t, py_t, theirs_t, ratios = [], [], [], []
            bo = bt = 0.0
            lt = eq = gt = 0
            for _ in range(args.pairs):
                shape = tuple(rng.choices(SIZES, SIZE_WEIGHTS, k=ndim))
                src, so, dst, do = _rand_pair(rng, m, ndim, nested_orders=False)
                stats = {}
                t_o, steps = _best_time(lambda: optimal.plan_uncached(src, so, dst, do, shape, mesh_shape, ITEMSIZE,
                                                                       stats=stats), args.repeats)
                caps += stats.get("capped", False)
                expansions.append(stats.get("expanded", 0))
                slowest = max(slowest, (t_o, mesh_shape, shape, stats.get("expanded", 0)), key=lambda r: r[0])
                optimal.NATIVE = False
                t_p, py_steps = _best_time(lambda: optimal.plan_uncached(src, so, dst, do, shape, mesh_shape, ITEMSIZE),
                                           args.repeats)
                optimal.NATIVE = switch
                assert py_steps == steps, ("native and Python searches differ", src, so, dst, do, shape, mesh_shape)
                py_t.append(t_p)
                t_f, full = _best_time(lambda: _full_uncached(src, so, dst, do, shape, mesh_shape), args.repeats)
                fb, _ = plan_cost(full, shape, mesh_shape, ITEMSIZE)
                full_rows.setdefault(mesh_shape, []).append((t_f, fb))
                a = _torch_spec(tmesh, src, so, shape)
                b = _torch_spec(tmesh, dst, do, shape)
                t_t, infos = _best_time(lambda: tr._gen_transform_infos_non_cached(a, b), args.repeats)
                theirs, end = _their_steps(infos, src, so)
                assert end == dst, (src, dst, end)
                ob, _ = plan_cost(steps, shape, mesh_shape, ITEMSIZE)
                plan_cost_rows.setdefault(mesh_shape, []).append(ob)
                assert fb <= ob * (1 + 1e-12) + 1e-9, ("full planner moves more bytes than the search", src, dst)
                tb, _ = plan_cost(theirs, shape, mesh_shape, ITEMSIZE)
                sb, _ = plan_cost(simple_plan(src, so, dst, do), shape, mesh_shape, ITEMSIZE)
                assert ob <= sb * (1 + 1e-12) + 1e-9, "worse than the simple planner"
                ours_t.append(t_o)
                theirs_t.append(t_t)
                ratios.append(t_t / t_o)
                bo += ob
                bt += tb
                if ob < tb * (1 - 1e-12):
                    lt += 1
                elif ob > tb * (1 + 1e-12) + 1e-9:
                    gt += 1
                else:
                    eq += 1
            worse_total += gt
            all_ours += ours_t
            all_theirs += theirs_t
            all_py += py_t
            pm = per_mesh.setdefault(mesh_shape, ([], [], []))
            pm[0].extend(ours_t)
            pm[1].extend(theirs_t)
            pm[2].extend(py_t)
            us = lambda v: f"{v * 1e6:8.0f}"  # noqa: E731
            print(f"{str(mesh_shape):>12} {ndim:>2} {args.pairs:>3} | {us(statistics.median(ours_t))} {us(max(ours_t))} | "
                  f"{statistics.median(py_t) * 1e6:7.0f} {max(py_t) * 1e6:7.0f} | "
                  f"{us(statistics.median(theirs_t)):>9} {us(max(theirs_t)):>9} | "
                  f"{statistics.median(theirs_t) / statistics.median(ours_t):6.2f} {max(theirs_t) / max(ours_t):6.2f} | "
                  f"{_ratio(bo, bt)} {lt:>3} {eq:>3} {gt:>2}")
            rows.append((mesh_shape, ndim, ours_t, theirs_t))
    print()
    p90 = lambda v: sorted(v)[int(0.9 * len(v))] * 1e6  # noqa: E731
    print(f"all rows: ours median {statistics.median(all_ours) * 1e6:.0f} us, p90 {p90(all_ours):.0f} us, "
          f"worst {max(all_ours) * 1e6:.0f} us; Python search median {statistics.median(all_py) * 1e6:.0f} us, "
          f"p90 {p90(all_py):.0f} us, worst {max(all_py) * 1e6:.0f} us; PyTorch median "
          f"{statistics.median(all_theirs) * 1e6:.0f} us, p90 {p90(all_theirs):.0f} us, worst {max(all_theirs) * 1e6:.0f} us")
    under = sum(t <= 100e-6 for t in all_ours)
    print(f"ours <= 100 us on {under}/{len(all_ours)} pairs; pairs where ours moves more bytes: {worse_total}; "
          f"expansion cap hit: {caps}; cached hit: {_cached_hit_us():.1f} us")
    met = max(all_ours) <= 100e-6
    print(f"worst-case target (<= 100 us per uncached plan, {'native' if native else 'Python'} search): "
          f"{'MET' if met else 'NOT MET'} (worst {max(all_ours) * 1e6:.0f} us: mesh {slowest[1]}, shape {slowest[2]}, "
          f"{slowest[3]} expansions)")
    ex = sorted(expansions)
    print(f"A* expansions per plan: median {statistics.median(ex):.0f}, p90 {ex[int(0.9 * len(ex))]}, max {ex[-1]}")
    print()
    print("per mesh (all tensor ranks): uncached plan time (us)")
    hdr3 = (f"{'mesh':>12} | {'ours med':>8} {'ours p90':>8} {'ours max':>8} | "
            f"{'py med':>7} {'py p90':>7} {'py max':>7} | {'torch med':>9} {'torch max':>9} | {'torch/ours med':>14}")
    print(hdr3)
    print("-" * len(hdr3))
    for mesh_shape, (o_t, t_t, p_t) in per_mesh.items():
        print(f"{str(mesh_shape):>12} | {statistics.median(o_t) * 1e6:8.0f} {p90(o_t):8.0f} {max(o_t) * 1e6:8.0f} | "
              f"{statistics.median(p_t) * 1e6:7.0f} {p90(p_t):7.0f} {max(p_t) * 1e6:7.0f} | "
              f"{statistics.median(t_t) * 1e6:9.0f} {max(t_t) * 1e6:9.0f} | "
              f"{statistics.median(t_t) / statistics.median(o_t):14.2f}")

    print()
    print("full planner (what redistribute runs: the search above, then flattened groups and the direct exchange),")
    print("uncached (us); bytes of the full plans over those of the search alone, same pairs")
    hdr4 = f"{'mesh':>12} | {'full med':>8} {'full p90':>8} {'full max':>8} | {'<= 100 us':>9} | {'bytes full/search':>17}"
    print(hdr4)
    print("-" * len(hdr4))
    all_full = []
    for mesh_shape, fr in full_rows.items():
        ft = [t for t, _ in fr]
        all_full += ft
        search_b = sum(plan_cost_rows[mesh_shape])
        print(f"{str(mesh_shape):>12} | {statistics.median(ft) * 1e6:8.0f} {p90(ft):8.0f} {max(ft) * 1e6:8.0f} | "
              f"{sum(t <= 100e-6 for t in ft):>5}/{len(ft):<3} | {_ratio(sum(b for _, b in fr), search_b):>17}")
    print(f"all rows: full planner median {statistics.median(all_full) * 1e6:.0f} us, p90 {p90(all_full):.0f} us, "
          f"worst {max(all_full) * 1e6:.0f} us; <= 100 us on {sum(t <= 100e-6 for t in all_full)}/{len(all_full)} pairs")

    # PyTorch's graph-based (min-cost) planner on a few pairs with random nested orders
    print()
    print("with random nested shard orders: PyTorch graph (min-cost) planner, a few pairs per row")
    hdr2 = f"{'mesh':>12} {'nd':>2} {'n':>3} | {'ours med':>8} {'ours max':>8} | {'graph med':>10} {'graph max':>10} | {'bytes ours/torch':>16} {'>':>2}"
    print(hdr2)
    print("-" * len(hdr2))
    g_worse = 0
    for mesh_shape in MESHES:
        tmesh = _torch_mesh(mesh_shape)
        m = len(mesh_shape)
        for ndim in NDIMS:
            if graph_spent > args.graph_budget:
                break
            ot, gt_, bo, bt, worse = [], [], 0.0, 0.0, 0
            for _ in range(args.graph_pairs):
                shape = tuple(rng.choices(SIZES, SIZE_WEIGHTS, k=ndim))
                src, so, dst, do = _rand_pair(rng, m, ndim, nested_orders=True)
                t_o, steps = _best_time(lambda: optimal.plan_uncached(src, so, dst, do, shape, mesh_shape, ITEMSIZE), args.repeats)
                a = _torch_spec(tmesh, src, so, shape)
                b = _torch_spec(tmesh, dst, do, shape)
                t0 = time.perf_counter()
                infos = tr._gen_transform_infos_non_cached(a, b, True)
                t_g = time.perf_counter() - t0
                graph_spent += t_g
                theirs, end = _their_steps(infos, src, so)
                ob, _ = plan_cost(steps, shape, mesh_shape, ITEMSIZE)
                tb, _ = plan_cost(theirs, shape, mesh_shape, ITEMSIZE)
                worse += ob > tb * (1 + 1e-12) + 1e-9
                ot.append(t_o)
                gt_.append(t_g)
                bo += ob
                bt += tb
            g_worse += worse
            print(f"{str(mesh_shape):>12} {ndim:>2} {len(ot):>3} | {statistics.median(ot) * 1e6:8.0f} {max(ot) * 1e6:8.0f} | "
                  f"{statistics.median(gt_) * 1e6:10.0f} {max(gt_) * 1e6:10.0f} | {_ratio(bo, bt)} {worse:>2}")
    print()
    print(f"graph planner pairs where ours moves more bytes: {g_worse}; total runtime {time.perf_counter() - t_start:.1f} s")
    dist.destroy_process_group()
    return 1 if worse_total or g_worse else 0


def _ratio(a: float, b: float) -> str:
    """``a / b`` in the bytes column; ``-`` when no plan of the row moves a byte (tiny --pairs)."""
    return f"{a / b:16.3f}" if b else f"{'-':>16}"


def _full_uncached(src, so, dst, do, shape, mesh_shape):
    """``flatten.best_plan`` with every cache it uses emptied first (the per-mesh tables stay)."""
    optimal._cached.cache_clear()
    exchange.exchange_loads.cache_clear()
    return flatten._cached.__wrapped__(tuple(mesh_shape), normalize_links(None, len(mesh_shape)), src, so, dst, do,
                                       tuple(shape), ITEMSIZE)


def _cached_hit_us() -> float:
    """Time of a plan-cache hit (``optimal_plan`` with the same arguments again)."""
    args = ((Shard(0), Partial("sum"), Replicate()), ((0, (0,)),), (Replicate(), Shard(1), Shard(0)),
            ((0, (2,)), (1, (1,))), (1024, 4096), (2, 2, 4), ITEMSIZE)
    optimal.optimal_plan(*args)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        optimal.optimal_plan(*args)
    return (time.perf_counter() - t0) / n * 1e6


def _prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p


if __name__ == "__main__":
    raise SystemExit(main())
