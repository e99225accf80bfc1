"""Context parallelism: attention over a sequence sharded across ranks (ring or gathered keys)."""
from .layout import SeqLayout, contiguous, head_tail, per_document
from .ring import ring_attention

__all__ = ["SeqLayout", "contiguous", "head_tail", "per_document", "ring_attention"]
