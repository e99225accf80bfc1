"""Placements: how one mesh dimension holds a tensor, one module per placement.

``base.py`` is the interface every placement answers (the library asks it, never its class);
``layout.py`` the arithmetic of local shapes, offsets and blocks built on it.  ``PLACEMENTS``
is the registry: the public placement classes, exported at the top level and known to pickling
and torch.compile by this list.  A new placement is its module and its import line here.
"""
from .base import LAST, ORDERED, Placement, chunk, chunk_sizes, partial_op, shard_dim, unfake
from .layout import (OrderedPlacements, ShardOrder, all_planned, compute_local_shape, default_shard_order, display,
                     execution_order, local_blocks, local_shape_and_offset, normalize_placements, rules_view, split_local,
                     unpartial, validate_shard_order)
from .partial import REDUCE_OPS, NormPartial, Partial
from .replicate import Replicate
from .shard import Shard
from .ragged import RaggedShard
from .strided import StridedShard, strided_runs

PLACEMENTS: tuple[type[Placement], ...] = tuple(  # (a slotted dataclass leaves its first class among the subclasses)
    c for c in Placement.__subclasses__() if globals().get(c.__name__) is c)
"""The public placement classes: every module's class imported above (``NormPartial`` is an
internal Partial of norms, not a direct subclass)."""

__all__ = [cls.__name__ for cls in PLACEMENTS] + ["Placement", "NormPartial", "PLACEMENTS", "REDUCE_OPS",
           "ORDERED", "LAST", "ShardOrder", "OrderedPlacements", "chunk", "chunk_sizes", "unfake", "shard_dim", "partial_op", "unpartial",
           "all_planned", "rules_view", "normalize_placements", "default_shard_order", "validate_shard_order",
           "execution_order", "split_local", "local_shape_and_offset", "local_blocks", "compute_local_shape", "display",
           "strided_runs"]
