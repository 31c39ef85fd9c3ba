"""Per-request block tables on top of the BlockPool, with automatic prefix caching."""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.kv_cache.block_pool import BlockPool, KVBlock
from engine.core.kv_cache.events import BlockStored, KVCacheEvent
from engine.core.kv_cache.hashing import (BlockHasher, event_extra_keys, lora_extra_key,
                                          update_block_hashes)
from engine.core.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (requests admitted)
    hits: int = 0     # of those, tokens served from the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hasher: BlockHasher | None = None, enable_events: bool = False) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hasher = hasher or BlockHasher()
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_events and enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # Block ids mirrored as ints so the model runner reads them without touching KVBlock.
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks. The last token is always left to
        compute, because its logits are needed to sample."""
        if not self.enable_caching:
            return [], 0
        update_block_hashes(request, self.block_size, self.hasher)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None,
                       num_reserved_blocks: int = 0) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` after the request's computed tokens (plus
        the prefix hits in `new_computed_blocks`). Returns the fresh blocks, or None
        with nothing changed if they do not fit while keeping `num_reserved_blocks`
        free (the watermark, for admissions)."""
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id, ())
        hits = new_computed_blocks or ()
        bs = self.block_size
        num_computed = request.num_computed_tokens + len(hits) * bs
        num_required = -(-(num_computed + num_new_tokens) // bs)
        num_new_blocks = num_required - len(blocks) - len(hits)
        if num_new_blocks > 0 or hits:
            # A hit with ref_cnt 0 sits in the free queue; taking it shrinks the free
            # pool, so it cannot also be counted as room for new blocks.
            num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
            available = self.block_pool.num_free_blocks - num_evictable_hits - num_reserved_blocks
            if num_new_blocks > available:
                return None
        if not blocks:
            blocks = self.req_to_blocks[request_id] = []
            self.req_to_block_ids[request_id] = []
            self.num_cached_blocks[request_id] = 0
        block_ids = self.req_to_block_ids[request_id]
        if hits:
            self.block_pool.touch(hits)
            blocks.extend(hits)
            block_ids.extend(b.block_id for b in hits)
            self.num_cached_blocks[request_id] = len(blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        if new_blocks:
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(num_computed + num_new_tokens,
                                                         request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        update_block_hashes(request, self.block_size, self.hasher)
        hashes = request.block_hashes
        pool = self.block_pool
        if pool.events is None:
            for i in range(start, num_full):
                pool.cache_block(blocks[i], hashes[i])
        else:
            self._cache_and_announce(request, blocks, hashes, start, num_full)
        self.num_cached_blocks[request.request_id] = num_full

    def _cache_and_announce(self, request: Request, blocks: list[KVBlock], hashes: list,
                            start: int, stop: int) -> None:
        """One BlockStored per run of hashes new to the cache; a duplicate breaks the
        run, and the next run names it as parent (it is cached, by its first copy)."""
        pool, bs, tokens = self.block_pool, self.block_size, request.all_token_ids
        lora = request.lora_request
        lora_key = lora_extra_key(request)
        run_start = None
        for i in range(start, stop + 1):
            stored = i < stop and pool.cache_block(blocks[i], hashes[i])
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
                    lora_name=None if lora is None else lora.lora_name))
                run_start = None

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Release the request's blocks. `num_valid_tokens`: how many of its tokens
        really have KV written; blocks past that were registered in the prefix cache
        at allocation (before the forward) and must not serve hits, e.g. when a
        request is preempted in the same step that granted it tokens."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks and num_valid_tokens is not None:
            for block in blocks[num_valid_tokens // self.block_size:]:
                self.block_pool.uncache(block)
        if blocks:
            # Tail first: the end of a chain is the least likely to be shared, so it
            # should be evicted before the head.
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
