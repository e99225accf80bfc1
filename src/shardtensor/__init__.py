"""shardtensor: an SPMD sharded tensor for PyTorch (API mirrors ``torch.distributed.tensor``)."""
from .version import __version__
from .comm import run_spmd
from .mesh import DeviceMesh, init_device_mesh
from .placement import PLACEMENTS, Partial, Placement, RaggedShard, Replicate, Shard, StridedShard
from .spec import DTensorSpec, compute_local_shape_and_global_offset
from .tensor import DTensor, distribute_tensor
from .factories import empty, full, ones, rand, randn, zeros
from .implicit import implicit_replication
from . import dispatch  # installs DTensor's op entry points
from .dispatch.fallback import strict_sharding
from . import errors
from .errors import MixedTensorError, ShardingError
from . import debug
from .debug import CommTrace, visualize_sharding
from .redistribute import explain_redistribute
from .fsdp import MixedPrecisionPolicy, fully_shard
from . import parallel
from .parallel import distribute_module
from .transfer import WeightSync, transfer
from .auto import AutoPlan, autoshard

__all__ = [
    "CommTrace", "DTensor", "DTensorSpec", "DeviceMesh", "Partial", "Placement", "RaggedShard", "Replicate", "Shard",
    "StridedShard",
    "distribute_tensor", "explain_redistribute", "init_device_mesh", "run_spmd", "visualize_sharding",
    "MixedTensorError", "ShardingError", "errors", "implicit_replication", "strict_sharding",
]
__all__ += ["distribute_module", "empty", "full", "ones", "rand", "randn", "zeros"]
__all__ += ["MixedPrecisionPolicy", "fully_shard", "compute_local_shape_and_global_offset", "transfer",
            "WeightSync", "AutoPlan", "autoshard"]


def _allow_in_weights_only_load() -> None:
    """``torch.load(weights_only=True)`` (torch's default) rebuilds saved DTensors: the classes
    a pickled DTensor names are registered as safe, as torch does for its own DTensor."""
    import torch

    from .placement import NormPartial, OrderedPlacements

    torch.serialization.add_safe_globals([DTensor, DTensorSpec, DeviceMesh, *PLACEMENTS, NormPartial, OrderedPlacements])


_allow_in_weights_only_load()
