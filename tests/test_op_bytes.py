"""The bytes side of the op sweep (``benchmarks/op_bytes.py``) on the ops whose choices issue 60
named: ours never receives more than PyTorch's DTensor on these cases, and the counter sees
DTensor's collectives (those issued inside its op handler too), so a zero cannot pass by accident."""
from __future__ import annotations

import warnings

import pytest

import op_bytes

OPS = {"mul", "div", "tanh", "where", "max.reduction_with_dim", "std", "flatten", "index_put", "linalg.cross",
       "nn.functional.grid_sample", "rsub"}


@pytest.mark.timeout(600)
def test_the_named_patterns_never_move_more_bytes_than_dtensor():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = op_bytes.cases(OPS, 1, ("shard", "partial", "2d"))
    both = [r for r in rows if r["ours"] == "right" and r["theirs"] == "right"]
    seen = {r["op"] for r in rows}
    assert all(any(n == op or n.startswith(op + ".") for n in seen) for op in OPS) and len(both) >= 40, (seen, len(both))
    assert sum(r["theirs_bytes"] for r in both) > 0  # DTensor's collectives are counted
    more = [f"{r['op']} {r['layout']} {r['shapes']}: ours {r['ours_bytes']} B, DTensor {r['theirs_bytes']} B"
            for r in both if r["ours_bytes"] > r["theirs_bytes"]]
    assert not more, "\n".join(more)
    assert not [r for r in rows if r["theirs"] == "right" and r["ours"] != "right"]
    assert sum(r["ours_bytes"] for r in both) < sum(r["theirs_bytes"] for r in both)
