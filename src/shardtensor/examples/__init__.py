"""Runnable examples behind the command line: ``shardtensor demo`` trains ``tiny_lm`` with FSDP x TP
and checks its losses against one device; ``shardtensor tour`` walks through placements,
redistribution and elementwise ops (``tour``).  They import shardtensor as a user script would."""
