"""Command line: ``shardtensor demo``."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardtensor", description="SPMD sharded tensors for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="tour of placements, redistribution and elementwise ops on a (2, 2) mesh")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main()
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
