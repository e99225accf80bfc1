"""The dispatch layer: route an op, propagate, redistribute, run the local kernel, wrap.

Importing it installs it into ``DTensor`` (``tensor.install_dispatch``); the package does.

Decompositions (``decompose.py``) run here too: they are the ops without a rule, rewritten into
ops that have one, on the DTensors themselves.
"""
from ..tensor import install_dispatch
from .decompose import DECOMPOSITIONS, decomposition, find_decomposition
from .fallback import strict_sharding
from .functions import REPAIRED, finish, optimizers_take_foreach, torch_function
from .run import dispatch, route

install_dispatch(dispatch, torch_function, finish, REPAIRED)  # DTensor's ops run here from now on
optimizers_take_foreach()

__all__ = ["dispatch", "route", "torch_function", "DECOMPOSITIONS", "decomposition", "find_decomposition", "strict_sharding"]
