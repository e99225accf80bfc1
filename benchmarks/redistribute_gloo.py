"""Redistribution over real gloo processes: shardtensor vs PyTorch DTensor, same run, same data.

    python benchmarks/redistribute_gloo.py            # 4 MiB and 16 MiB fp32, 20 timed iterations (~1.5 min)
    python benchmarks/redistribute_gloo.py --quick    # 1 MiB, 3 timed iterations (smoke run)

Four gloo processes on localhost (spawned with ``tests/distributed.py``'s ``run_multiprocess``,
``OMP_NUM_THREADS=1``).  Every case builds the same source value in both libraries (Shard and
Replicate sources with ``distribute_tensor`` from one dense tensor; Partial sources with
``DTensor.from_local`` of per-rank integer-valued pieces whose sum is the dense tensor) and
redistributes it to the target placements.

Per case, each library:
  * correctness, once: the result's placements and shape, its local piece against the slice of
    the dense tensor (``torch.chunk`` per mesh dim) and ``full_tensor()`` against the dense tensor;
    values are small integers in fp32, so every comparison is exact.  Any mismatch makes the
    script exit 1.
  * bytes sent per rank, once, untimed:
      - "model" bytes under the ring model (all_gather (k-1)*in, reduce_scatter (k-1)/k*in,
        all_reduce 2(k-1)/k*in, all_to_all (k-1)/k*in).  Ours: the ``CommEvent``s of
        ``shardtensor.comm.recording()``, cross-checked against a count of the torch.distributed
        calls it makes.  PyTorch's: a ``TorchDispatchMode`` that sees its functional collectives
        (``torch.ops._c10d_functional.*``, ``torch.ops._dtensor.shard_dim_alltoall``) plus wrappers
        around the ``torch.distributed`` collective functions (in case any are used).
      - "wire" bytes: what the process really wrote to its gloo sockets, the ``wchar`` delta of
        ``/proc/self/io`` around the call (Linux; gloo's headers add a few hundred bytes).  Gloo's
        reduce_scatter_tensor is an all-reduce of the whole input, so it writes 2(k-1)/k*in, twice
        the ring model; the wire column shows it.  The script also predicts the wire bytes from the
        counted calls with gloo's real factors and warns if the measurement disagrees (a missed
        collective would show up there).
  * time: ``--warmup`` untimed then ``--iters`` timed iterations, ours and PyTorch's alternating;
    each iteration starts after a barrier, its time is the slowest rank's (all_reduce MAX of the
    per-rank times after the loop); the table shows the median.

Bytes and wire columns are per rank (the max over ranks; every case here is symmetric).
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

from _gloo_setup import ROOT, run_multiprocess  # noqa: E402  (puts src/ and tests/ on sys.path)

WORLD = 4
MiB = 1 << 20

# name, mesh shape, source, target  (S<d> = Shard(d), R = Replicate, P = Partial(sum))
CASES = [
    ("S0->R", (4,), ("S0",), ("R",)),
    ("S0->S1", (4,), ("S0",), ("S1",)),
    ("P->R", (4,), ("P",), ("R",)),
    ("P->S0", (4,), ("P",), ("S0",)),
    ("(S0,S0)->(R,R)", (2, 2), ("S0", "S0"), ("R", "R")),
    ("(S0,S0)->(R,S0)", (2, 2), ("S0", "S0"), ("R", "S0")),
    ("(S1,S0)->(S0,S1)", (2, 2), ("S1", "S0"), ("S0", "S1")),
    ("(P,P)->(R,R)", (2, 2), ("P", "P"), ("R", "R")),
]

# bytes this rank sends, as a multiple of the input's bytes, for group size k
RING = {  # the ring model used for the "bytes" columns
    "all_gather": lambda k: k - 1,
    "all_reduce": lambda k: 2 * (k - 1) / k,
    "reduce_scatter": lambda k: (k - 1) / k,
    "all_to_all": lambda k: (k - 1) / k,
    "broadcast": lambda k: k - 1,  # source rank only; not used by these cases
}
GLOO_WIRE = dict(RING, reduce_scatter=lambda k: 2 * (k - 1) / k)  # gloo: reduce_scatter = all-reduce


# ---------------------------------------------------------------------------------------------
# byte counters
# ---------------------------------------------------------------------------------------------

def _wchar() -> int | None:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class CallCounter:
    """Collectives seen below the libraries: (kind, group size, input bytes, bytes sent by the ring model)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, float]] = []
        self.unknown: list[str] = []

    def add(self, kind: str, k: int, in_bytes: int, sent: float | None = None) -> None:
        if k <= 1:
            return
        self.calls.append((kind, k, in_bytes, RING[kind](k) * in_bytes if sent is None else sent))

    def model_bytes(self) -> int:
        return int(round(sum(c[3] for c in self.calls)))

    def wire_bytes(self) -> int:
        """Bytes gloo should write for these calls (its reduce_scatter is an all-reduce)."""
        tot = 0.0
        for kind, k, nb, sent in self.calls:
            tot += sent if kind == "all_to_all" else GLOO_WIRE[kind](k) * nb
        return int(round(tot))

    def summary(self) -> str:
        short = {"all_gather": "AG", "all_reduce": "AR", "reduce_scatter": "RS", "all_to_all": "A2A",
                 "broadcast": "BC"}
        return " + ".join(f"{short[kind]}(k={k},{nb / MiB:g}MiB)" for kind, k, nb, _ in self.calls) or "-"


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _a2a_sent(inp, in_splits, k: int, me: int) -> float:
    if not in_splits:
        return _nbytes(inp) * (k - 1) / k
    row = _nbytes(inp) / max(1, inp.shape[0])
    return row * (sum(in_splits) - in_splits[me])


class DistPatch:
    """Wrap the torch.distributed collective functions; count the outermost call only."""

    NAMES = ["all_gather", "all_gather_into_tensor", "_all_gather_base", "all_reduce", "reduce_scatter",
             "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single", "all_to_all", "broadcast"]

    def __init__(self) -> None:
        self.counter: CallCounter | None = None
        self._depth = 0
        self._orig: dict = {}

    def install(self) -> None:
        import torch.distributed as dist

        for name in self.NAMES:
            if hasattr(dist, name):
                self._orig[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._orig[name]))

    def _wrap(self, name, fn):
        import torch.distributed as dist

        def wrapper(*args, **kwargs):
            c = self.counter
            if c is not None and self._depth == 0:
                try:
                    self._count(dist, c, name, args, kwargs)
                except Exception as e:  # noqa: BLE001 - counting must never break the call
                    c.unknown.append(f"dist.{name}: cannot count ({e})")
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        wrapper.__wrapped__ = fn
        return wrapper

    @staticmethod
    def _count(dist, c: CallCounter, name: str, args, kwargs) -> None:
        def arg(i, key, default=None):
            return args[i] if len(args) > i else kwargs.get(key, default)

        if name == "all_gather":
            g = arg(2, "group")
            c.add("all_gather", dist.get_world_size(g), _nbytes(arg(1, "tensor")))
        elif name in ("all_gather_into_tensor", "_all_gather_base"):
            g = arg(2, "group")
            c.add("all_gather", dist.get_world_size(g), _nbytes(arg(1, "input_tensor")))
        elif name == "all_reduce":
            g = arg(2, "group")
            c.add("all_reduce", dist.get_world_size(g), _nbytes(arg(0, "tensor")))
        elif name in ("reduce_scatter_tensor", "_reduce_scatter_base"):
            g = arg(3, "group")
            c.add("reduce_scatter", dist.get_world_size(g), _nbytes(arg(1, "input")))
        elif name == "reduce_scatter":
            g = arg(3, "group")
            c.add("reduce_scatter", dist.get_world_size(g), sum(_nbytes(t) for t in arg(1, "input_list")))
        elif name == "all_to_all_single":
            g = arg(4, "group")
            k = dist.get_world_size(g)
            inp = arg(1, "input")
            me = dist.get_rank(g)
            c.add("all_to_all", k, _nbytes(inp), _a2a_sent(inp, arg(3, "input_split_sizes"), k, me))
        elif name == "all_to_all":
            g = arg(2, "group")
            k = dist.get_world_size(g)
            ins = arg(1, "input_tensor_list")
            me = dist.get_rank(g)
            tot = sum(_nbytes(t) for t in ins)
            c.add("all_to_all", k, tot, tot - _nbytes(ins[me]))
        elif name == "broadcast":
            g = arg(2, "group")
            src = arg(1, "src")
            if dist.get_rank() == src:
                c.add("broadcast", dist.get_world_size(g), _nbytes(arg(0, "tensor")))


def _functional_counter_mode(counter: CallCounter):
    """A TorchDispatchMode that counts the functional collectives PyTorch DTensor issues."""
    import torch
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    def size_of(name):
        return _resolve_process_group(name).size()

    def rank_in(name):
        import torch.distributed as dist

        return dist.get_rank(_resolve_process_group(name))

    IGNORE = {"wait_tensor", "_wrap_tensor_autograd", "broadcast", "broadcast_"}

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # a DTensor op: its handler runs, this mode still on, and sees its collectives
            kwargs = kwargs or {}
            ns = func.namespace
            op = func._schema.name.split("::")[-1]
            if ns == "_c10d_functional":
                if op == "all_gather_into_tensor":
                    counter.add("all_gather", args[1], _nbytes(args[0]))
                elif op == "all_gather_into_tensor_coalesced":
                    for t in args[0]:
                        counter.add("all_gather", args[1], _nbytes(t))
                elif op == "reduce_scatter_tensor":
                    counter.add("reduce_scatter", args[2], _nbytes(args[0]))
                elif op == "reduce_scatter_tensor_coalesced":
                    for t in args[0]:
                        counter.add("reduce_scatter", args[2], _nbytes(t))
                elif op in ("all_reduce", "all_reduce_"):
                    counter.add("all_reduce", size_of(args[2]), _nbytes(args[0]))
                elif op in ("all_reduce_coalesced", "all_reduce_coalesced_"):
                    k = size_of(args[2])
                    for t in args[0]:
                        counter.add("all_reduce", k, _nbytes(t))
                elif op == "all_to_all_single":
                    k = size_of(args[3])
                    counter.add("all_to_all", k, _nbytes(args[0]), _a2a_sent(args[0], args[2], k, rank_in(args[3])))
                elif op not in IGNORE:
                    counter.unknown.append(str(func))
            elif ns == "_dtensor" and op == "shard_dim_alltoall":
                k = size_of(args[3])
                counter.add("all_to_all", k, _nbytes(args[0]))
            return func(*args, **kwargs)

    return Mode()


# ---------------------------------------------------------------------------------------------
# the ranks
# ---------------------------------------------------------------------------------------------

def _placements(lib, spec):
    out = []
    for s in spec:
        if s == "R":
            out.append(lib.Replicate())
        elif s == "P":
            out.append(lib.Partial())
        else:
            out.append(lib.Shard(int(s[1:])))
    return out


def _expected_local(full, mesh_shape, coord, spec):
    import torch

    piece = full
    for j, s in enumerate(spec):
        if s.startswith("S"):
            d = int(s[1:])
            parts = torch.chunk(piece, mesh_shape[j], dim=d)
            piece = parts[coord[j]] if coord[j] < len(parts) else piece.narrow(d, 0, 0)
    return piece


def _materialize(t):
    """A plain tensor whose collective has completed (PyTorch may hand back an AsyncCollectiveTensor)."""
    from torch.distributed import _functional_collectives as funcol

    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _check(lib_name, y, lib, full, mesh, mesh_shape, tgt) -> list[str]:
    import torch

    errs = []
    ft = _materialize(y.full_tensor())  # collective first, before any check can fail
    try:
        want_pl = tuple(_placements(lib, tgt))
        if tuple(y.placements) != want_pl:
            errs.append(f"{lib_name}: placements {tuple(y.placements)} != {want_pl}")
        if tuple(y.shape) != tuple(full.shape):
            errs.append(f"{lib_name}: shape {tuple(y.shape)} != {tuple(full.shape)}")
        local = _materialize(y.to_local())
        want = _expected_local(full, mesh_shape, list(mesh.get_coordinate()), tgt)
        if tuple(local.shape) != tuple(want.shape) or not torch.equal(local, want):
            errs.append(f"{lib_name}: local piece differs from the dense slice "
                        f"(shape {tuple(local.shape)} vs {tuple(want.shape)})")
        if not torch.equal(ft, full):
            errs.append(f"{lib_name}: full_tensor() differs from the dense tensor")
    except Exception as e:  # noqa: BLE001
        errs.append(f"{lib_name}: check raised {type(e).__name__}: {e}")
    return errs


def _worker(rank, world, cfg):
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as t_init_mesh

    import shardtensor as st
    from shardtensor import comm

    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    torch.manual_seed(0)

    patch = DistPatch()
    patch.install()
    errors: list[str] = []
    notes: list[str] = []

    # our meshes and PyTorch's, built in the same order on every rank
    meshes = {}
    for shape in sorted({c[1] for c in CASES}):
        meshes[shape] = (st.init_device_mesh("cpu", shape), t_init_mesh("cpu", shape))

    # -- hand check of the PyTorch-side counter: one all_gather of 1 MiB over 4 ranks ----------
    from torch.distributed import _functional_collectives as funcol

    c = CallCounter()
    x = torch.ones(MiB // 4)
    funcol.all_gather_tensor(x, 0, meshes[(4,)][1]).wait()  # first call outside the window
    dist.barrier()
    w0 = _wchar()
    with _functional_counter_mode(c):
        _materialize(funcol.all_gather_tensor(x, 0, meshes[(4,)][1]))
    w1 = _wchar()
    if c.model_bytes() != 3 * MiB:
        errors.append(f"counter self-check: funcol all_gather of 1 MiB over 4 ranks counted {c.model_bytes()} B, "
                      f"want {3 * MiB}")
    if w0 is not None and abs((w1 - w0) - 3 * MiB) > 64 * 1024:
        errors.append(f"counter self-check: 1 MiB all_gather over 4 ranks wrote {w1 - w0} B to the wire, want ~{3 * MiB}")

    rows = []
    for size_mib in cfg["sizes"]:
        n = int((size_mib * MiB // 4) ** 0.5)
        gshape = (n, n)
        for ci, (name, mshape, src, tgt) in enumerate(CASES):
            ours_mesh, their_mesh = meshes[mshape]
            seed = 1000 * ci + size_mib
            if "P" in src:
                # every rank contributes one integer-valued piece; the value is their sum
                parts = [torch.randint(-4, 5, gshape, generator=torch.Generator().manual_seed(seed * 10 + r)).float()
                         for r in range(world)]
                full = torch.stack(parts).sum(0)
                ours_x = st.DTensor.from_local(parts[rank].clone(), ours_mesh, _placements(st, src), shape=gshape)
                their_x = tdt.DTensor.from_local(parts[rank].clone(), their_mesh, _placements(tdt, src),
                                                 shape=torch.Size(gshape), stride=full.stride())
            else:
                full = torch.randint(-9, 10, gshape, generator=torch.Generator().manual_seed(seed)).float()
                ours_x = st.distribute_tensor(full, ours_mesh, _placements(st, src))
                their_x = tdt.distribute_tensor(full, their_mesh, _placements(tdt, src))
            ours_tgt = _placements(st, tgt)
            their_tgt = _placements(tdt, tgt)

            def ours():
                return ours_x.redistribute(ours_mesh, ours_tgt).to_local()

            def theirs():
                return _materialize(their_x.redistribute(their_mesh, their_tgt).to_local())

            label = f"{name} {size_mib}MiB"
            # correctness (also the first call of each: one-time warnings and caches happen here)
            errs = _check("ours", ours_x.redistribute(ours_mesh, ours_tgt), st, full, ours_mesh, mshape, tgt)
            errs += _check("torch", their_x.redistribute(their_mesh, their_tgt), tdt, full, their_mesh, mshape, tgt)
            errors += [f"rank {rank} {label}: {e}" for e in errs]

            # bytes, untimed
            ours_calls, their_calls = CallCounter(), CallCounter()
            dist.barrier()
            w0 = _wchar()
            patch.counter = ours_calls
            with comm.recording() as log:
                ours()
            patch.counter = None
            w1 = _wchar()
            dist.barrier()
            w2 = _wchar()
            patch.counter = their_calls
            with _functional_counter_mode(their_calls):
                theirs()
            patch.counter = None
            w3 = _wchar()
            ours_model = sum(e.bytes_sent for e in log.events if e.rank == rank)
            their_model = their_calls.model_bytes()
            ours_wire = None if w0 is None else w1 - w0
            their_wire = None if w2 is None else w3 - w2
            if abs(ours_model - ours_calls.model_bytes()) > 16:
                notes.append(f"rank {rank} {label}: ours recorded {ours_model} B but its torch.distributed calls "
                             f"make {ours_calls.model_bytes()} B under the ring model")
            for who, cc, wire in (("ours", ours_calls, ours_wire), ("torch", their_calls, their_wire)):
                if cc.unknown:
                    notes.append(f"rank {rank} {label}: {who}: uncounted collectives {cc.unknown}")
                if wire is not None and abs(wire - cc.wire_bytes()) > 0.01 * cc.wire_bytes() + 64 * 1024:
                    notes.append(f"rank {rank} {label}: {who} wrote {wire} B to gloo sockets but the counted calls "
                                 f"({cc.summary()}) predict {cc.wire_bytes()} B")

            # time: warmup, then alternate ours / theirs, each after a barrier
            times = torch.zeros(2, cfg["iters"], dtype=torch.float64)
            gc.collect()
            gc.disable()
            for it in range(cfg["warmup"] + cfg["iters"]):
                for j, fn in enumerate((ours, theirs) if it % 2 == 0 else (theirs, ours)):
                    jj = j if it % 2 == 0 else 1 - j
                    dist.barrier()
                    t0 = time.perf_counter()
                    out = fn()
                    dt = time.perf_counter() - t0
                    del out
                    if it >= cfg["warmup"]:
                        times[jj, it - cfg["warmup"]] = dt
            gc.enable()
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            stats = torch.tensor([ours_model, their_model, -1 if ours_wire is None else ours_wire,
                                  -1 if their_wire is None else their_wire], dtype=torch.float64)
            lo = stats.clone()
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            rows.append(dict(
                case=name, mesh=mshape, size=size_mib,
                ours_ms=statistics.median(times[0].tolist()) * 1e3,
                theirs_ms=statistics.median(times[1].tolist()) * 1e3,
                ours_min_ms=min(times[0].tolist()) * 1e3, theirs_min_ms=min(times[1].tolist()) * 1e3,
                ours_bytes=int(stats[0]), theirs_bytes=int(stats[1]),
                ours_wire=None if stats[2] < 0 else int(stats[2]), theirs_wire=None if stats[3] < 0 else int(stats[3]),
                asymmetric=bool((stats - lo)[:2].abs().max() > 0),
                ours_ops=ours_calls.summary(), theirs_ops=their_calls.summary(),
            ))
            if rank == 0:
                r = rows[-1]
                print(f"  done {label}: ours {r['ours_ms']:.2f} ms, torch {r['theirs_ms']:.2f} ms",
                      file=sys.stderr, flush=True)
    return dict(rank=rank, rows=rows, errors=errors, notes=notes)


# ---------------------------------------------------------------------------------------------
# the parent
# ---------------------------------------------------------------------------------------------

def _fmt_mib(b):
    return "n/a" if b is None else f"{b / MiB:.3f}"


def _ratio(a, b):
    if a is None or b is None:
        return "n/a"
    if b == 0:
        return "1.00" if a == 0 else "inf"
    return f"{a / b:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 MiB, 3 iterations (smoke run)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per case and library (default 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 3)")
    ap.add_argument("--timeout", type=float, default=600, help="overall seconds before the ranks are killed")
    a = ap.parse_args(argv)
    cfg = dict(sizes=[1] if a.quick else [4, 16],
               iters=a.iters if a.iters is not None else (3 if a.quick else 20),
               warmup=a.warmup if a.warmup is not None else (1 if a.quick else 3))

    import torch

    import shardtensor

    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        commit = "?"
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0], os.getcwd())] + sys.argv[1:])
    print(f"# {cmd} | torch {torch.__version__} | shardtensor {shardtensor.__version__} ({commit}) | "
          f"{WORLD} gloo ranks on localhost, OMP_NUM_THREADS=1, {os.cpu_count()} CPUs ({platform.machine()}) | "
          f"fp32, sizes {cfg['sizes']} MiB, warmup {cfg['warmup']}, iters {cfg['iters']}", flush=True)

    t0 = time.monotonic()
    results = run_multiprocess(_worker, world_size=WORLD, timeout=a.timeout, args=(cfg,))
    wall = time.monotonic() - t0

    rows = results[0]["rows"]
    head = ["case", "mesh", "size", "ours ms", "theirs ms", "ratio", "ours MiB", "theirs MiB", "ratio",
            "ours wire", "theirs wire"]
    table = [head]
    for r in rows:
        table.append([r["case"], "x".join(map(str, r["mesh"])), f"{r['size']} MiB",
                      f"{r['ours_ms']:.2f}", f"{r['theirs_ms']:.2f}", _ratio(r["ours_ms"], r["theirs_ms"]),
                      _fmt_mib(r["ours_bytes"]), _fmt_mib(r["theirs_bytes"]), _ratio(r["ours_bytes"], r["theirs_bytes"]),
                      _fmt_mib(r["ours_wire"]), _fmt_mib(r["theirs_wire"])])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = []
    for i, row in enumerate(table):
        lines.append("  ".join(c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    print("\n".join(lines))
    print("\nms: median over iterations of the slowest rank's time; ratio = ours/theirs (< 1: ours is faster).")
    print("MiB: bytes sent per rank under the ring model (ours: comm.recording(); theirs: counted functional "
          "collectives).")
    print("wire: MiB each rank actually wrote to its gloo sockets (/proc/self/io wchar); gloo's reduce_scatter is an "
          "all-reduce, so it writes 2(k-1)/k of its input, twice the ring model.")
    print("\ncollectives per case (k = group size, input bytes per rank):")
    for r in rows:
        print(f"  {r['case']:<18} {r['size']:>2} MiB  ours: {r['ours_ops']}")
        print(f"  {'':<18} {'':>2}      torch: {r['theirs_ops']}")
    if any(r["asymmetric"] for r in rows):
        print("\nnote: some cases send different byte counts on different ranks; the table shows the max.")
    notes = [n for res in results for n in res["notes"]]
    if notes:
        print("\nnotes:")
        for n in notes:
            print("  " + n)
    errors = [e for res in results for e in res["errors"]]
    print(f"\ntotal wall time {wall:.1f} s")
    if errors:
        print(f"\nFAILED: {len(errors)} wrong results:", file=sys.stderr)
        for e in errors:
            print("  " + e, file=sys.stderr)
        return 1
    print("all results correct (both libraries, every case, every rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
