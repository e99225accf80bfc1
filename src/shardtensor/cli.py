"""Command line: ``shardtensor demo``, ``shardtensor tour`` and ``shardtensor plan``."""
from __future__ import annotations

import argparse
import json
import os
import sys

PLAN_EXAMPLE = ("examples: shardtensor plan --mesh 2,2 --shape 8,6 --src S0,S1 --dst R,S0\n"
                "          shardtensor plan --mesh 2,2 --shape 8,6 --src S0,S1 --dst-mesh 4 --dst-ranks 4,5,6,7 --dst S1\n"
                "          shardtensor plan --auto llama3-8b --mesh 8,8 --memory 80GiB\n"
                "          shardtensor plan --auto gpt:layers=4,batch=16 --mesh 2,4 --names dp,tp")


def _add_plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="show the steps, bytes per rank and a lower bound of a redistribution (no processes needed)",
        description="Plan a redistribution from placements alone and price every step with the alpha-beta "
                    "model: mesh dim, transition (display form), collective, bytes sent per rank, group size; "
                    "then the total and a lower bound.", epilog=PLAN_EXAMPLE)
    p.add_argument("--mesh", required=True, metavar="K0,K1,...", help="mesh shape, e.g. 2,2")
    p.add_argument("--shape", metavar="N0,N1,...", help="global tensor shape, e.g. 8,6 ('' for a scalar)")
    p.add_argument("--src", metavar="PLACEMENTS",
                   help="source placements, one per mesh dim: R, S<d>, P, P(<op>); e.g. S0,S1 or P(max),S1")
    p.add_argument("--dst", metavar="PLACEMENTS", help="target placements, e.g. R,S0")
    p.add_argument("--auto", metavar="MODEL_SPEC",
                   help="instead of one redistribution: choose how to shard a model's training on the mesh "
                        "(autoshard) and print the plan; MODEL_SPEC is demo, gpt, llama or llama3-8b, with "
                        "overrides such as llama3-8b:layers=4,batch=16 (keys: layers, dim, heads, kv_heads, ffn, "
                        "vocab, seq, batch, dtype)")
    p.add_argument("--names", metavar="N0,N1,...", help="with --auto: mesh dim names (default d0,d1,...)")
    p.add_argument("--memory", metavar="BYTES", help="with --auto: memory per rank, e.g. 80GiB, 512MiB or 1e9")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd", "none"),
                   help="with --auto: the optimizer whose states count in memory (default adamw)")
    p.add_argument("--dtype", default="float32", help="element type: float32 (default), bf16, fp16, float64, int8, ...")
    p.add_argument("--src-order", metavar="D:J,J[;D:J,...]",
                   help="source shard order of nested tensor dims, mesh dims first-applied first, e.g. 0:1,0")
    p.add_argument("--dst-order", metavar="D:J,J[;D:J,...]", help="target shard order, e.g. 0:1,0")
    p.add_argument("--dst-mesh", metavar="K0,K1,...",
                   help="move to another mesh of this shape: show the point-to-point transfers instead")
    p.add_argument("--src-ranks", metavar="R,R,...", help="with --dst-mesh: the source mesh's ranks (default 0..n-1)")
    p.add_argument("--dst-ranks", metavar="R,R,...", help="with --dst-mesh: the target mesh's ranks (default 0..m-1)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--png", metavar="FILE", help="also draw the layouts before/after each step to this PNG")
    return p


def _bytes_arg(parser: argparse.ArgumentParser, text: str) -> float:
    units = {"kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "b": 1}
    low = text.strip().lower()
    for unit, size in units.items():
        if low.endswith(unit):
            low, scale = low[: -len(unit)], size
            break
    else:
        scale = 1
    try:
        value = float(low) * scale
    except ValueError:
        parser.error(f"--memory {text!r}: give bytes, e.g. 80GiB, 512MiB or 1e9")
    if not value > 0:
        parser.error(f"--memory {text!r}: must be positive")
    return value


def _auto(args, parser: argparse.ArgumentParser) -> int:
    from .auto import autoshard
    from .examples.models import build

    try:
        shape = tuple(int(k) for k in args.mesh.split(","))
    except ValueError:
        parser.error(f"--mesh {args.mesh!r}: give sizes such as 8,8")
    names = tuple(args.names.split(",")) if args.names else tuple(f"d{j}" for j in range(len(shape)))
    budget = _bytes_arg(parser, args.memory) if args.memory else None
    try:
        model, batch = build(args.auto)
        plan = autoshard(model, (shape, names), batch, memory_per_rank=budget, optimizer=args.optimizer)
    except (ValueError, TypeError) as e:
        parser.exit(2, f"shardtensor plan: error: {e}\n")
    print(plan, flush=True)
    return 0


def _plan(args, parser: argparse.ArgumentParser) -> int:
    from .redistribute.explain import Explanation, explain_redistribute

    if args.auto:
        return _auto(args, parser)
    missing = [f"--{n}" for n in ("shape", "src", "dst") if getattr(args, n) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)} (or --auto MODEL_SPEC)")

    try:
        moving = {} if args.dst_mesh is None and args.src_ranks is None and args.dst_ranks is None else {
            "dst_mesh": args.dst_mesh, "src_ranks": args.src_ranks, "dst_ranks": args.dst_ranks}
        ex = explain_redistribute(args.mesh, args.shape, args.src, args.dst, dtype=args.dtype,
                                  src_order=args.src_order, dst_order=args.dst_order, **moving)
    except (ValueError, TypeError) as e:
        parser.error(str(e))  # exits with code 2
    if args.png and moving:
        parser.error("--png draws plans on one mesh; a move to another mesh is shown as text or --json")
    if args.png:
        assert isinstance(ex, Explanation)  # a move is refused above
        try:
            ex.draw(args.png)
        except ImportError as e:
            parser.exit(2, f"shardtensor plan: error: --png needs matplotlib ({e})\n")
        except OSError as e:
            parser.exit(2, f"shardtensor plan: error: cannot write {args.png}: {e}\n")
    try:
        print(json.dumps(ex.to_dict(), indent=2) if args.json else ex.to_text(), flush=True)
    except BrokenPipeError:  # e.g. piped into head
        sys.stdout = open(os.devnull, "w")
        return 0
    if args.png:
        print(f"wrote {args.png}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """``--device`` names a device this process has (a usage error, exit 2, otherwise)."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        parser.error(f"--device {device!r}: {e}")
    if dev.type not in ("cpu", "cuda"):
        parser.error(f"--device {device!r}: the demo runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here (torch.cuda.is_available() is False); "
                     "use --device cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardtensor", description="SPMD sharded tensors for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny transformer with FSDP x TP on a (2, 2) mesh; losses vs one device")
    demo.add_argument("--backend", choices=("sim", "gloo", "nccl"), default="sim",
                      help="sim: 4 ranks as threads in this process (default); gloo: 4 real processes "
                           "(or torchrun's); nccl: under torchrun, one GPU per rank")
    demo.add_argument("--device", default="cpu", help="cpu (default) or cuda: where parameters and activations live")
    demo.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    demo.add_argument("--png", metavar="FILE", help="also plot the parameter pieces per rank to this PNG")
    sub.add_parser("tour", help="tour of placements, redistribution and elementwise ops on a (2, 2) mesh")
    plan_parser = _add_plan_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .examples.tiny_lm import main as train_main

        _check_device(parser, args.device)
        if args.backend == "nccl" and "RANK" not in os.environ:
            parser.error("--backend nccl runs under torchrun, one process per GPU: "
                         "torchrun --nproc-per-node <GPUs> -m shardtensor demo --backend nccl --device cuda")

        return train_main(backend=args.backend, steps=args.steps, png=args.png, device=args.device)
    if args.command == "tour":
        from .examples.tour import main as tour_main

        return tour_main()
    if args.command == "plan":
        return _plan(args, plan_parser)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
