"""A full-attention group's rules (vLLM's FullAttentionManager): every block of the
context stays while the request runs, and a cached prefix is a hit block by block from
the start, so any prefix of a hit is a hit too."""
from __future__ import annotations

from engine.core.kv_cache.block_pool import BlockPool, KVBlock
from engine.core.kv_cache.hashing import BlockHash


class FullAttentionManager:
    window: int | None = None
    # A hit of n blocks holds a hit of every m < n: a shorter agreed length is a cut.
    prefix_closed = True

    def __init__(self, pool: BlockPool, group: int, block_size: int) -> None:
        self.pool = pool
        self.group = group
        self.block_size = block_size

    def find_longest_cache_hit(self, block_hashes: list[BlockHash],
                               max_blocks: int) -> list[KVBlock]:
        """The cached blocks of the longest prefix of at most `max_blocks` blocks."""
        get = self.pool.cached_by_group[self.group].get
        hits: list[KVBlock] = []
        for block_hash in block_hashes[:max_blocks]:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def remove_skipped_blocks(self, blocks: list[KVBlock], block_ids: list[int],
                              num_computed_tokens: int) -> None:
        """Full attention reads the whole context: nothing is ever skipped."""
