"""`BlockPool`: the paged KV cache's blocks on the host side: which are free, which rows hold them, and which
hold a cached prefix that a later request may reuse.

The cache is a pool of `num_blocks` blocks of `block_size` positions; a row's block table lists the blocks
that hold its positions in order. A block is in exactly one of three states:
- **in use**: held by one or more rows (`refs` > 0; a cached prefix block may be shared by several);
- **cached**: held by no row but keyed by the prefix it holds, reusable until its memory is needed (least
  recently released first);
- **free**: neither.

A full block's key is a SHA-256 digest chained over the prefix: the previous block's key, the adapter's
identity and the block's token ids. The identity names the adapter's registration (its load generation, not
only its name) and the state of the files it was read from (`AdapterPool.prefix_id`), so an adapter reloaded
under the same name, or read again from files rewritten meanwhile, never reuses the old weights' blocks, and a
prefix under one adapter is never reused under another (the keys and values differ).

Not thread-safe: the engine's loop owns it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import struct
from collections.abc import Sequence

__all__ = ["BlockPool", "PrefixStats", "block_keys"]


def block_keys(identity: str, tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """The keys of the full blocks of `tokens` under the adapter `identity` ("" for the base model), and `salt`
    when given: key i covers tokens[: (i + 1) · block_size]. Keys of other salts never meet, so requests share
    cached blocks only within one salt (vLLM's `cache_salt`: no tenant can time another's prompts)."""
    keys, previous = [], identity.encode()
    if salt is not None:  # a digest: never an identity's bytes, and `identity` holds no NUL to blur the parts
        previous = hashlib.sha256(previous + b"\0" + salt.encode()).digest()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}q", *tokens[start: start + block_size])
        previous = hashlib.sha256(previous + b"\0" + block).digest()
        keys.append(previous)
    return keys


@dataclasses.dataclass
class PrefixStats:
    """Prefix-cache counters since start: prompt tokens looked up and found cached, blocks evicted."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockPool:
    """`num_blocks` blocks of `block_size` positions; with `prefix_caching`, full blocks stay keyed by the
    prefix they hold after their rows let them go (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # refs 0, keyed; LRU first
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self.stats = PrefixStats()

    @property
    def num_available(self) -> int:
        """Blocks an `allocate` may take: the free ones and the cached ones no row holds."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a keyed prefix (in use or not)."""
        return len(self._key_of)

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold `positions` positions."""
        return -(-positions // self.block_size)

    def match(self, keys: Sequence[bytes], limit: int) -> list[int]:
        """Takes a reference on each block of the longest cached prefix of `keys` (at most `limit` blocks) and
        returns them; the lookup counts in `stats` as `limit` blocks' tokens asked for."""
        blocks = []
        if self.prefix_caching:
            for key in keys[:limit]:
                block = self._by_key.get(key)
                if block is None:
                    break
                blocks.append(block)
        for block in blocks:
            self._take(block)
        self.stats.queried_tokens += limit * self.block_size
        self.stats.hit_tokens += len(blocks) * self.block_size
        return blocks

    def allocate(self, n: int) -> list[int] | None:
        """n blocks for one row (free ones first, then the least recently released cached ones, whose keys are
        dropped), or None, changing nothing, when fewer than n are available."""
        if n > self.num_available:
            return None
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._by_key[self._key_of.pop(block)]
                self.stats.evicted_blocks += 1
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def commit(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Keys `blocks[i]` by `keys[i]` once the block holds that prefix's keys and values (its step has run).
        A block already keyed, or a key another block already holds (the same prefix computed twice), stays
        as it is."""
        if not self.prefix_caching:
            return
        for block, key in zip(blocks, keys):
            if block not in self._key_of and key not in self._by_key:
                self._key_of[block] = key
                self._by_key[key] = block

    def release(self, blocks: Sequence[int]) -> None:
        """Drops a row's references to its blocks. A block no row holds becomes cached if keyed, else free; the
        last blocks of a row are the first evicted (a prefix's head serves more requests than its tail)."""
        for block in reversed(blocks):
            if self.refs[block] < 1:
                raise ValueError(f"block {block} released more often than taken")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            del self._cached[block]
        self.refs[block] += 1
