"""Per-request block tables on top of the BlockPool, with automatic prefix caching.

A request has one block table per KV-cache group (engine/core/kv_cache/groups.py), all
of the same length: entry i stands for tokens i * block_size .. (i + 1) * block_size - 1
in every group. A full-attention group keeps every block; a sliding-window group
replaces the blocks behind its window with NULL_BLOCK as the request advances
(engine/core/kv_cache/sliding_window_manager.py). Since the tables advance together, a
step needs the same number of new blocks in every group, and a request's cached prefix
is a block count shared by all groups."""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.kv_cache.block_pool import NULL_BLOCK, BlockPool, KVBlock
from engine.core.kv_cache.events import BlockStored, KVCacheEvent
from engine.core.kv_cache.full_attention_manager import FullAttentionManager
from engine.core.kv_cache.groups import KVCacheLayout, full_attention_layout
from engine.core.kv_cache.hashing import (BlockHasher, event_extra_keys, lora_extra_key,
                                          update_block_hashes)
from engine.core.kv_cache.sliding_window_manager import SlidingWindowManager
from engine.core.request import Request

# Per group, a request's blocks: what get_computed_blocks and allocate_slots pass around.
GroupBlocks = tuple[list[KVBlock], ...]


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (requests admitted)
    hits: int = 0     # of those, tokens served from the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hasher: BlockHasher | None = None, enable_events: bool = False,
                 layout: KVCacheLayout | None = None) -> None:
        """`layout`: the model's KV-cache groups; None: one full-attention group."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hasher = hasher or BlockHasher()
        self.layout = layout = layout or full_attention_layout(1)
        self.num_groups = layout.num_groups
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_events and enable_caching,
                                    num_groups=self.num_groups)
        self.managers = [FullAttentionManager(self.block_pool, g, block_size) if w is None
                         else SlidingWindowManager(self.block_pool, g, block_size, w)
                         for g, w in enumerate(layout.windows)]
        # The groups that drop blocks as a request advances (none for Llama).
        self.windowed = [(g, m) for g, m in enumerate(self.managers) if m.window is not None]
        # Request id -> its blocks per group, and their ids mirrored as ints so the
        # model runner reads them without touching KVBlock.
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        self.req_to_block_ids: dict[str, tuple[list[int], ...]] = {}
        # Request id -> how many leading blocks (the same in every group) are registered
        # in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # No hits, shaped like hits; shared, so never written to.
        self.no_hits: GroupBlocks = tuple([] for _ in range(self.num_groups))

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest cached prefix of full blocks that every group can resume from, as
        each group's blocks for it and its length in tokens. The last token is always
        left to compute, because its logits are needed to sample.

        A request with SamplingParams.prompt_logprobs reads no hits (vLLM's rule): a
        cached block holds K/V but no logits, and each prompt position's logits are what
        its prompt logprobs come from, so the whole prompt is recomputed. Its blocks are
        still registered for others, as any request's."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self.no_hits, 0
        hashes = update_block_hashes(request, self.block_size, self.hasher)
        max_blocks = (request.num_tokens - 1) // self.block_size
        managers = self.managers
        if len(managers) == 1:
            hits = managers[0].find_longest_cache_hit(hashes, max_blocks)
            return (hits,), len(hits) * self.block_size
        # Each group's longest hit within the length agreed so far, until all agree (vLLM's
        # hybrid rule). The length only shrinks; a full-attention hit stays valid when it
        # does (cut at the end), a windowed one must be looked for again.
        found: list[list[KVBlock] | None] = [None] * len(managers)
        agreed, settled = max_blocks, False
        while not settled:
            settled = True
            for g, manager in enumerate(managers):
                hit = found[g]
                if hit is not None and (len(hit) == agreed
                                        or (manager.prefix_closed and len(hit) > agreed)):
                    continue
                hit = found[g] = manager.find_longest_cache_hit(hashes, agreed)
                if len(hit) < agreed:
                    agreed, settled = len(hit), False
        return tuple(hit[:agreed] for hit in found), agreed * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: GroupBlocks | None = None,
                       num_reserved_blocks: int = 0,
                       num_lookahead_tokens: int = 0) -> GroupBlocks | None:
        """Make room for `num_new_tokens` after the request's computed tokens (plus
        the prefix hits in `new_computed_blocks`, one list per group), and for
        `num_lookahead_tokens` more (vLLM's: slots a draft model writes its proposals'
        K/V to after the step). Returns the fresh blocks per group, or None with no block
        taken if they do not fit while keeping `num_reserved_blocks` free (the watermark,
        for admissions). Blocks a window has left are freed first, even when the rest
        does not fit (they are never read again)."""
        request_id = request.request_id
        tables = self.req_to_blocks.get(request_id)
        if tables is not None and self.windowed:
            ids = self.req_to_block_ids[request_id]
            for g, manager in self.windowed:
                manager.remove_skipped_blocks(tables[g], ids[g], request.num_computed_tokens)
        num_hits = len(new_computed_blocks[0]) if new_computed_blocks else 0
        bs = self.block_size
        num_tokens = request.num_computed_tokens + num_hits * bs + num_new_tokens
        # The same in every group: the tables cover the same positions.
        num_new_blocks = -(-(num_tokens + num_lookahead_tokens) // bs) - num_hits
        if tables is not None:
            num_new_blocks -= len(tables[0])
        new_blocks = self.no_hits
        if num_new_blocks > 0 or num_hits or tables is None:
            if num_new_blocks > 0 or num_hits:
                # A hit with ref_cnt 0 sits in the free queue; taking it shrinks the free
                # pool, so it cannot also be counted as room for new blocks.
                evictable = sum(1 for group in new_computed_blocks for b in group
                                if b.ref_cnt == 0) if num_hits else 0
                available = self.block_pool.num_free_blocks - evictable - num_reserved_blocks
                if max(num_new_blocks, 0) * self.num_groups > available:
                    return None
            tables, new_blocks = self._take(request_id, tables, new_computed_blocks, num_hits,
                                            num_new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, tables, min(num_tokens, request.num_tokens))
        return new_blocks

    def _take(self, request_id: str, tables: GroupBlocks | None, hits: GroupBlocks | None,
              num_hits: int, num_new_blocks: int) -> tuple[GroupBlocks, GroupBlocks]:
        """Append the hits and `num_new_blocks` fresh blocks to every group's table
        (opened here for a new request); returns the tables and the fresh blocks."""
        pool = self.block_pool
        if tables is None:
            tables = self.req_to_blocks[request_id] = tuple([] for _ in self.managers)
            ids = self.req_to_block_ids[request_id] = tuple([] for _ in self.managers)
            self.num_cached_blocks[request_id] = 0
        else:
            ids = self.req_to_block_ids[request_id]
        if num_hits:
            for group_blocks, group_ids, group_hits in zip(tables, ids, hits):
                pool.touch(b for b in group_hits if b is not NULL_BLOCK)
                group_blocks.extend(group_hits)
                group_ids.extend(b.block_id for b in group_hits)
            self.num_cached_blocks[request_id] = len(tables[0])
        if num_new_blocks <= 0:
            return tables, self.no_hits
        new_blocks = tuple(pool.get_new_blocks(num_new_blocks) for _ in tables)
        for group_blocks, group_ids, group_new in zip(tables, ids, new_blocks):
            group_blocks.extend(group_new)
            group_ids.extend(b.block_id for b in group_new)
        return tables, new_blocks

    def held_blocks(self, request_id: str) -> list[int]:
        """Per group, the pool blocks the request holds (its table less NULL_BLOCKs)."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return [0] * self.num_groups
        return [len(blocks) if m.window is None else
                sum(1 for b in blocks if b is not NULL_BLOCK)
                for m, blocks in zip(self.managers, tables)]

    def _cache_full_blocks(self, request: Request, tables: GroupBlocks, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        request_id = request.request_id
        start = self.num_cached_blocks[request_id]
        if num_full <= start:
            return
        hashes = update_block_hashes(request, self.block_size, self.hasher)
        pool = self.block_pool
        # Blocks in start..num_full are never NULL_BLOCK: a window drops only blocks
        # before the computed tokens, which were cached when they were allocated.
        for g, blocks in enumerate(tables):
            if pool.events is None:
                for i in range(start, num_full):
                    pool.cache_block(blocks[i], hashes[i], g)
            else:
                self._cache_and_announce(request, blocks, hashes, start, num_full, g)
        self.num_cached_blocks[request_id] = num_full

    def _cache_and_announce(self, request: Request, blocks: list[KVBlock], hashes: list,
                            start: int, stop: int, group: int) -> None:
        """One BlockStored per run of hashes new to the group's cache; a duplicate breaks
        the run, and the next run names it as parent (it is cached, by its first copy)."""
        pool, bs, tokens = self.block_pool, self.block_size, request.all_token_ids
        lora = request.lora_request
        lora_key = lora_extra_key(request)
        window = self.managers[group].window
        run_start = None
        for i in range(start, stop + 1):
            stored = i < stop and pool.cache_block(blocks[i], hashes[i], group)
            if stored and run_start is None:
                run_start = i
            elif not stored and run_start is not None:
                pool.events.append(BlockStored(
                    block_hashes=hashes[run_start:i],
                    parent_block_hash=hashes[run_start - 1] if run_start else None,
                    token_ids=list(tokens[run_start * bs:i * bs]), block_size=bs,
                    extra_keys=[event_extra_keys(request.cache_salt, j, lora_key)
                                for j in range(run_start, i)],
                    lora_id=None if lora is None else lora.lora_int_id,
                    lora_name=None if lora is None else lora.lora_name,
                    group_idx=group, sliding_window=window))
                run_start = None

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Release the request's blocks in every group. `num_valid_tokens`: how many of
        its tokens really have KV written; blocks past that were registered in the
        prefix cache at allocation (before the forward) and must not serve hits, e.g.
        when a request is preempted in the same step that granted it tokens."""
        tables = self.req_to_blocks.pop(request.request_id, None)
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if not tables:
            return
        pool = self.block_pool
        for manager, blocks in zip(self.managers, tables):
            if num_valid_tokens is not None:
                # Past the valid tokens there is no NULL_BLOCK: windows drop computed blocks.
                for block in blocks[num_valid_tokens // self.block_size:]:
                    pool.uncache(block)
            # Tail first: the end of a chain is the least likely to be shared, so it
            # should be evicted before the head.
            if manager.window is None:
                pool.free_blocks(reversed(blocks))
            else:
                pool.free_blocks(b for b in reversed(blocks) if b is not NULL_BLOCK)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free every group's blocks past those covering the first `num_tokens` tokens:
        what a rejected draft had taken. They hold no hash: a block is registered only
        once all its tokens are in all_token_ids, and drafts never are."""
        tables = self.req_to_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if tables is None or len(tables[0]) <= keep:
            return
        pool = self.block_pool
        for blocks, ids in zip(tables, self.req_to_block_ids[request.request_id]):
            tail = blocks[keep:]
            del blocks[keep:], ids[keep:]
            pool.free_blocks(b for b in reversed(tail) if b is not NULL_BLOCK)

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
