"""Start of the gloo benchmarks: the checkout's ``src/`` and ``tests/`` on ``sys.path`` (no install
needed), and this folder too, so spawned children import the benchmark module by name."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (os.path.join(ROOT, "tests"), os.path.join(ROOT, "src"), HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from distributed import run_multiprocess  # noqa: E402

__all__ = ["HERE", "ROOT", "run_multiprocess"]
