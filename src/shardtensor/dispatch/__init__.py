"""The dispatch layer: route an op, propagate, redistribute, run the local kernel, wrap.

Decompositions (``decompose.py``) run here too: they are the ops without a rule, rewritten into
ops that have one, on the DTensors themselves.
"""
from .decompose import DECOMPOSITIONS, decomposition, find_decomposition
from .fallback import strict_sharding
from .functions import torch_function
from .run import dispatch, route

__all__ = ["dispatch", "route", "torch_function", "DECOMPOSITIONS", "decomposition", "find_decomposition", "strict_sharding"]
