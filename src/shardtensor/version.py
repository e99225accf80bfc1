"""shardtensor's version (kept with pyproject.toml's; part of torch.compile's cache keys)."""

__version__ = "0.1.0"
