"""Shared test set-up.  pytest puts this directory on ``sys.path``, so test modules import the
helpers here by name: ``opcheck`` (differential op checks against dense torch) and
``distributed`` (real gloo processes)."""
from __future__ import annotations

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
