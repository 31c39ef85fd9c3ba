"""A sliding-window group's rules (vLLM's SlidingWindowManager). A query at position p
reads keys p - W + 1 .. p only, so once a request has computed n tokens, the blocks
wholly before position n - W + 1 are never read again: they go back to the pool (still
cached, for other requests' prefix hits) and their table entries become NULL_BLOCK.
A request thus holds about W / block_size blocks plus its step's chunk, whatever its
length (groups.group_peak_blocks).

A cached prefix of h tokens serves this group only if the keys the next query reads,
positions h - W + 1 .. h - 1, are cached: the ceil((W - 1) / block_size) blocks before
the block boundary h. The blocks before those need not be cached at all; so the longest
hit is found from the right (vLLM's rule), and a shorter hit is not simply a cut of a
longer one."""
from __future__ import annotations

from engine.core.kv_cache.block_pool import NULL_BLOCK, BlockPool, KVBlock
from engine.core.kv_cache.hashing import BlockHash


class SlidingWindowManager:
    prefix_closed = False

    def __init__(self, pool: BlockPool, group: int, block_size: int, window: int) -> None:
        self.pool = pool
        self.group = group
        self.block_size = block_size
        self.window = window
        # Blocks a hit must have cached right before its end (the next query's window).
        self.blocks_before_hit = -(-(window - 1) // block_size)

    def find_longest_cache_hit(self, block_hashes: list[BlockHash],
                               max_blocks: int) -> list[KVBlock]:
        """The longest hit of at most `max_blocks` blocks: NULL_BLOCK for the blocks
        before the window, then the cached ones. A run of cached blocks from the start
        that is shorter than the window is a hit too (its next query reads them all)."""
        need = self.blocks_before_hit
        if need == 0:  # W == 1: a query reads only itself
            return [NULL_BLOCK] * max_blocks
        get = self.pool.cached_by_group[self.group].get
        run: list[KVBlock] = []  # the cached run ending at the block last looked at, reversed
        for i in range(max_blocks - 1, -1, -1):
            block = get(block_hashes[i])
            if block is None:
                run.clear()
                continue
            run.append(block)
            if len(run) == need:
                run.reverse()
                return [NULL_BLOCK] * i + run
        run.reverse()
        return run

    def remove_skipped_blocks(self, blocks: list[KVBlock], block_ids: list[int],
                              num_computed_tokens: int) -> None:
        """Drop the blocks the next query's window has left (all its later queries see
        less still). Called before a step allocates, so the freed blocks can serve it."""
        num_skipped = (num_computed_tokens - self.window + 1) // self.block_size
        i = min(num_skipped, len(blocks)) - 1
        freed: list[KVBlock] = []
        # From the window's edge back to the last block dropped before.
        while i >= 0 and blocks[i] is not NULL_BLOCK:
            freed.append(blocks[i])
            blocks[i] = NULL_BLOCK
            block_ids[i] = NULL_BLOCK.block_id
            i -= 1
        if freed:
            # Oldest first, so it is evicted first: a later prefix hit needs the blocks
            # right before its end, the newest ones.
            freed.reverse()
            self.pool.free_blocks(freed)
