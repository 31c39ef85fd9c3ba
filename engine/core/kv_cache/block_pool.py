"""Physical KV blocks: ref counts, an LRU free queue and the prefix-cache hash map."""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from engine.core.kv_cache.events import AllBlocksCleared, BlockRemoved, KVCacheEvent
from engine.core.kv_cache.hashing import BlockHash


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set once the block is full and registered in the prefix cache, with the
        # KV-cache group whose cache holds it.
        self.block_hash: BlockHash | None = None
        self.group = 0

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


# What a block-table entry holds once a sliding window has dropped its block (vLLM's
# null block): a placeholder, not one of the pool's blocks. Its id, 0, is written into
# the tables the model runner uploads; the attention kernels never read an entry whose
# block lies wholly behind every query's window (kernels.dispatch.paged_attention), and
# no slot mapping points into it (tokens are written inside the window), so whoever
# owns the real block 0 is never disturbed. Its ref count stays 1, so a "ref_cnt == 0"
# test (a free cache hit) never counts it; the managers never touch or free it.
NULL_BLOCK = KVBlock(0)
NULL_BLOCK.ref_cnt = 1


class BlockPool:
    """Owns every block. A block with ref_cnt 0 sits in the free queue; if it still
    carries a hash it stays findable in the cache until it is reused (lazy eviction).

    The free queue is an OrderedDict so that popping the LRU head, appending at the
    tail and pulling a revived cache hit out of the middle are all O(1).

    With several KV-cache groups (engine/core/kv_cache/groups.py) each group has its own
    hash map, as vLLM keys its cache by (hash, group): the same tokens are cached once
    per group, in different blocks, and each copy is evicted on its own."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 enable_events: bool = False, num_groups: int = 1) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_by_group: list[dict[BlockHash, KVBlock]] = [{} for _ in range(num_groups)]
        # Group 0's map: the whole cache of a model with one group.
        self.cached_blocks = self.cached_by_group[0]
        # KV-cache events since the last take_events(); None when nobody listens.
        self.events: list[KVCacheEvent] | None = [] if enable_events else None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        cached = self.cached_by_group[block.group]
        if cached.get(block.block_hash) is block:
            del cached[block.block_hash]
            events = self.events
            if events is not None:
                # Evictions of one allocation go out as one event (per group).
                last = events[-1] if events else None
                if isinstance(last, BlockRemoved) and last.group_idx == block.group:
                    last.block_hashes.append(block.block_hash)
                else:
                    events.append(BlockRemoved([block.block_hash], group_idx=block.group))
        block.block_hash = None

    def uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            self._evict(block)

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVBlock | None:
        return self.cached_by_group[group].get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
            elif block.ref_cnt < 0:
                raise RuntimeError(f"double free of {block}")

    def cache_block(self, block: KVBlock, block_hash: BlockHash, group: int = 0) -> bool:
        """Register a full block in `group`'s cache; True if its hash is new there."""
        if block.block_hash is not None:
            return False
        # A duplicate (same content computed twice) stays uncached; the first copy
        # keeps serving hits.
        cached = self.cached_by_group[group]
        if block_hash in cached:
            return False
        block.block_hash = block_hash
        block.group = group
        cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash, e.g. after a failed step left blocks unwritten."""
        for cached in self.cached_by_group:
            for block in cached.values():
                block.block_hash = None
            cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KVCacheEvent]:
        events = self.events
        if not events:
            return []
        self.events = []
        return events
