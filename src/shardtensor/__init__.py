"""shardtensor: an SPMD sharded tensor for PyTorch (API mirrors ``torch.distributed.tensor``)."""
from .comm import run_spmd
from .mesh import DeviceMesh, init_device_mesh
from .placement import Partial, Placement, Replicate, Shard
from .spec import DTensorSpec
from .tensor import DTensor, distribute_tensor
from .factories import empty, full, ones, rand, randn, zeros
from .implicit import MixedTensorError, implicit_replication
from . import debug
from .debug import CommTrace, visualize_sharding
from .redistribute import explain_redistribute
from .fsdp import MixedPrecisionPolicy, fully_shard
from . import parallel
from .parallel import distribute_module

__all__ = [
    "CommTrace", "DTensor", "DTensorSpec", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard",
    "distribute_tensor", "explain_redistribute", "init_device_mesh", "run_spmd", "visualize_sharding",
    "MixedTensorError", "implicit_replication",
]
__all__ += ["distribute_module", "empty", "full", "ones", "rand", "randn", "zeros"]
__all__ += ["MixedPrecisionPolicy", "fully_shard"]
__version__ = "0.1.0"
