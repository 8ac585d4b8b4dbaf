"""A block-granular prefix cache with LRU eviction, keyed by the hash chain of the prompt's blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CacheHit", "PrefixCache"]


@dataclass(frozen=True, slots=True)
class CacheHit:
    """What a lookup found: tokens read from the cache and tokens this prompt will write into it."""

    cached_tokens: int
    created_tokens: int


class PrefixCache:
    """Full blocks of earlier prompts, most recently used last; only a shared prefix can hit."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.block_size = block_size
        self.capacity = capacity_blocks
        # An OrderedDict is an LRU list with O(1) touch and evict; values are unused.
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.hit_tokens = 0
        self.queried_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def lookup(self, hashes: Sequence[bytes], prompt_tokens: int) -> CacheHit:
        """Match the longest run of cached blocks from the start of the prompt, and touch them.

        At most ``prompt_tokens - 1`` tokens can hit: as in vLLM, the last prompt token is always
        computed, because its forward pass yields the first output token.
        """
        limit = max(0, prompt_tokens - 1) // self.block_size
        hit = 0
        for block_hash in hashes[:limit]:
            if block_hash not in self._blocks:
                break
            hit += 1
        self._touch(hashes[:hit])
        self.hit_tokens += hit * self.block_size
        self.queried_tokens += prompt_tokens
        return CacheHit(cached_tokens=hit * self.block_size, created_tokens=(len(hashes) - hit) * self.block_size)

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Store a prompt's full blocks once its prefill is done, evicting the least recently used."""
        if self.capacity == 0:
            return
        self._touch(hashes)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def _touch(self, hashes: Sequence[bytes]) -> None:
        # Last block first, so a prompt's head ends up most recent and its tail is evicted first
        # (as vLLM frees blocks): evicting a head block would orphan every block after it.
        for block_hash in reversed(hashes):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
