"""See into it: a trace of every collective, and drawings of placements.

``CommTrace`` records the collectives inside a ``with`` block (kind, mesh dim, group, bytes,
dtype, time and the module/op that caused them) and writes summaries, JSON and Chrome traces.
``visualize_sharding`` draws which ranks hold which block of a DTensor (ASCII, rich, PNG).
``CommDebugMode`` counts them under torch's functional-collective ops, as torch's does.
``DispatchProfile`` times dispatch, placement decisions and planning per op; ``cache_stats``
gives the decision and plan caches' counters.
"""
from .comm_mode import CommDebugMode
from .overhead import DispatchProfile, cache_stats
from .trace import CommTrace, name_modules
from .visualize import describe_sharding, visualize_sharding

__all__ = ["CommDebugMode", "CommTrace", "DispatchProfile", "cache_stats", "describe_sharding", "name_modules", "visualize_sharding"]
