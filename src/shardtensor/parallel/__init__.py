"""Tensor parallelism over a 1-D mesh (mirrors ``torch.distributed.tensor.parallel``).

A plan maps module names (fnmatch patterns, one per dotted level) to a style; the style
shards the module's parameters and installs forward hooks that convert inputs and outputs:

====================  ==================  ===============================  ===========================
style                 parameters          input (default -> runtime)       output (runtime -> default)
====================  ==================  ===============================  ===========================
ColwiseParallel       Linear W, b: S(0)   R -> R                           S(-1) -> S(-1), to_local
                      Embedding W: S(1)   R -> R                           S(-1) -> S(-1), to_local
RowwiseParallel       Linear W: S(1),     S(-1) -> S(-1)                   Partial -> R, to_local
                      b: R
                      Embedding W: S(0)   R -> R                           Partial -> R, to_local
SequenceParallel      all: R              S(seq) -> S(seq)                 as computed (DTensor)
PrepareModuleInput    --                  input_layouts -> desired         --
PrepareModuleOutput   --                  --                               output_layouts -> desired
====================  ==================  ===============================  ===========================

Plain ``torch.Tensor`` inputs are taken as this rank's local piece in the declared layout;
their global shape comes from the module (``in_features``) where it can, otherwise from one
small all-gather of the local sizes, so uneven shards (e.g. 14 features over 4 ranks) work.

``loss_parallel()`` computes ``F.cross_entropy`` on class-sharded logits from per-row statistics
(``loss.py``).
"""
from .api import parallelize_module
from .module import distribute_module
from .loss import loss_parallel
from .style import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput,
                    PrepareModuleOutput, RowwiseParallel, SequenceParallel)

__all__ = [
    "ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput",
    "RowwiseParallel", "SequenceParallel", "distribute_module", "loss_parallel", "parallelize_module",
]
