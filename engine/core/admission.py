"""admission="no_evict" (TensorRT-LLM's GUARANTEED_NO_EVICT): a request starts only if
the blocks of its whole prompt plus max_tokens (capped by max_model_len) fit beside
what the running requests may still take at their worst, so a running request always
finds its next block and nothing is ever preempted. Blocks several requests share (prefix
hits) are in the pool once and counted once."""
from __future__ import annotations

from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request


def worst_case_blocks(request: Request, max_model_len: int, block_size: int) -> int:
    max_tokens = request.max_tokens if request.max_tokens is not None else max_model_len
    return -(-min(request.num_prompt_tokens + max_tokens, max_model_len) // block_size)


def still_needed(request: Request, kv: KVCacheManager, max_model_len: int) -> int:
    """Blocks the request may still allocate beyond the ones it holds."""
    held = len(kv.req_to_blocks.get(request.request_id, ()))
    return max(0, worst_case_blocks(request, max_model_len, kv.block_size) - held)


def reserved_blocks(running: list[Request], kv: KVCacheManager, max_model_len: int) -> int:
    return sum(still_needed(r, kv, max_model_len) for r in running)


def fits(request: Request, hit_blocks: list, kv: KVCacheManager, max_model_len: int,
         reserved: int, watermark_blocks: int) -> bool:
    """Whether `request`, with these prefix hits, may start beside `reserved` blocks. A hit
    nobody holds sits in the free pool, so taking it costs a free block too."""
    fresh = worst_case_blocks(request, max_model_len, kv.block_size) - len(hit_blocks)
    evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
    return kv.num_free_blocks - evictable_hits - reserved - watermark_blocks >= fresh
