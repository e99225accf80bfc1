"""Shared test set-up.  pytest puts this directory on ``sys.path``, so test modules import the
helpers here by name: ``opcheck`` (differential op checks against dense torch) and
``distributed`` (real gloo processes)."""
from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread while a test module runs: simulated ranks are threads, and torch's pool
    in each of them would oversubscribe the cores (every op ~30x slower)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def pytest_collection_modifyitems(config, items):
    """Two markers keep CI's run under its hour.  ``long``: a third-party training run of a minute
    or more that repeats what a shorter test of the same kind already checks (more torchtitan
    parallelisms, more Hugging Face models); skipped unless SHARDTENSOR_LONG=1
    (``bash scripts/test_long.sh`` runs exactly these).  ``main_release``: run on the main torch release only
    (``scripts/test_torch.sh`` sets SHARDTENSOR_OTHER_RELEASE=1 for the others): the library's own
    algorithms, which read no torch API that changes between releases (the OpInfo sweep, the
    redistribution planner, executor and block exchange, ragged shards), and the gloo-process
    repeats of tests whose simulated-world form runs on every release (test_gloo, the drop-in's
    torchrun script, DCP and FSDP in processes still run on every release)."""
    skips = []
    if os.environ.get("SHARDTENSOR_LONG") != "1":
        skips.append(("long", "a long third-party run: SHARDTENSOR_LONG=1 (scripts/test_long.sh) runs it"))
    if os.environ.get("SHARDTENSOR_OTHER_RELEASE") == "1":
        skips.append(("main_release", f"main torch release only (our own algorithms, or a gloo repeat of a simulated test), not {torch.__version__}"))
    for item in items:
        for name, why in skips:
            if item.get_closest_marker(name) is not None:
                item.add_marker(pytest.mark.skip(reason=why))
