"""The one-launch Triton copy kernels (``shardtensor.kernels.gpu``), checked without a GPU.

Triton's interpreter runs its kernels on CPU tensors when ``TRITON_INTERPRET=1`` is set before
Triton is imported, so the whole contract suite of ``tests/test_kernels.py`` (uneven sizes,
padding, widening casts, non-contiguous inputs, every ``out=`` rule, errors before any write)
is rerun in a fresh process with ``SHARDTENSOR_TRITON=1``, which sends every call the kernels
take through them.  The child counts the calls that reached the kernels, so the test cannot pass
on the per-tensor path alone.  On a GPU, ``tests/test_gpu.py`` checks them on CUDA tensors.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHILD = """
import sys, pytest
from shardtensor.kernels import gpu
calls = {"chunk_cat": 0, "split": 0}
cc, sp = gpu.chunk_cat, gpu.split_with_sizes_copy
def counted_cc(*a):
    calls["chunk_cat"] += 1
    return cc(*a)
def counted_sp(*a):
    calls["split"] += 1
    return sp(*a)
gpu.chunk_cat, gpu.split_with_sizes_copy = counted_cc, counted_sp
rc = pytest.main(["-q", "-p", "no:cacheprovider", sys.argv[1]])
print("kernel calls", calls["chunk_cat"], calls["split"])
sys.exit(int(rc))
"""


def test_kernel_contract_suite_through_the_triton_kernels():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", SHARDTENSOR_TRITON="1")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT / "tests" / "test_kernels.py")],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    counts = [line for line in res.stdout.splitlines() if line.startswith("kernel calls")]
    assert counts, res.stdout[-2000:]
    n_cc, n_split = map(int, counts[-1].split()[2:])
    assert n_cc >= 100 and n_split >= 20, counts
