"""Copy kernels used around FSDP collectives (layouts in ``chunk_cat``'s module docstring)."""
from .chunk_cat import ChunkCatDimError, SplitSizesError, chunk_cat, chunk_cat_numel, split_with_sizes_copy

__all__ = ["ChunkCatDimError", "SplitSizesError", "chunk_cat", "chunk_cat_numel", "split_with_sizes_copy"]
