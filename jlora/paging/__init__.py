"""The paged KV cache: blocks of positions shared out to rows, and prefixes kept for reuse (`BlockPool`)."""

from jlora.paging.blocks import BlockPool, PrefixStats, block_keys

__all__ = ["BlockPool", "PrefixStats", "block_keys"]
