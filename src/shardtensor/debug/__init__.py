"""See into it: a trace of every collective, and drawings of placements.

``CommTrace`` records the collectives inside a ``with`` block (kind, mesh dim, group, bytes,
dtype, time and the module/op that caused them) and writes summaries, JSON and Chrome traces.
``visualize_sharding`` draws which ranks hold which block of a DTensor (ASCII, rich, PNG).
``DispatchProfile`` times dispatch, placement decisions and planning per op; ``cache_stats``
gives the decision and plan caches' counters.
"""
from .overhead import DispatchProfile, cache_stats
from .trace import CommTrace, name_modules
from .visualize import describe_sharding, visualize_sharding

__all__ = ["CommTrace", "DispatchProfile", "cache_stats", "describe_sharding", "name_modules", "visualize_sharding"]
