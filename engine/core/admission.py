"""admission="no_evict" (TensorRT-LLM's GUARANTEED_NO_EVICT): a request starts only if
the blocks of its whole prompt plus max_tokens (capped by max_model_len) fit beside
what the running requests may still take at their worst, so a running request always
finds its next block and nothing is ever preempted. Blocks several requests share (prefix
hits) are in the pool once and counted once. A sliding-window group's worst is not the
whole context but its window plus a step's chunk (`max_chunk` tokens at most), since it
frees what falls behind the window (engine/core/kv_cache/groups.group_peak_blocks)."""
from __future__ import annotations

from engine.core.kv_cache import KVCacheManager
from engine.core.kv_cache.block_pool import NULL_BLOCK
from engine.core.kv_cache.groups import group_peak_blocks
from engine.core.request import Request


def worst_case_tokens(request: Request, max_model_len: int) -> int:
    max_tokens = request.max_tokens if request.max_tokens is not None else max_model_len
    return min(request.num_prompt_tokens + max_tokens, max_model_len)


def worst_case_blocks(request: Request, kv: KVCacheManager, max_model_len: int,
                      max_chunk: int) -> list[int]:
    """Per group, the most blocks the request can hold at once."""
    tokens = worst_case_tokens(request, max_model_len)
    return [group_peak_blocks(w, tokens, kv.block_size, max_chunk) for w in kv.layout.windows]


def still_needed(request: Request, kv: KVCacheManager, max_model_len: int,
                 max_chunk: int) -> int:
    """Blocks the request may still allocate beyond the ones it holds."""
    worst = worst_case_blocks(request, kv, max_model_len, max_chunk)
    held = kv.held_blocks(request.request_id)
    return sum(max(0, w - h) for w, h in zip(worst, held))


def reserved_blocks(running: list[Request], kv: KVCacheManager, max_model_len: int,
                    max_chunk: int) -> int:
    return sum(still_needed(r, kv, max_model_len, max_chunk) for r in running)


def fits(request: Request, hit_blocks: tuple[list, ...], kv: KVCacheManager,
         max_model_len: int, max_chunk: int, reserved: int, watermark_blocks: int) -> bool:
    """Whether `request`, with these prefix hits (one list per group), may start beside
    `reserved` blocks. A hit nobody holds sits in the free pool, so taking it costs a
    free block too."""
    worst = worst_case_blocks(request, kv, max_model_len, max_chunk)
    fresh = sum(max(0, w - sum(1 for b in hits if b is not NULL_BLOCK))
                for w, hits in zip(worst, hit_blocks))
    evictable_hits = sum(1 for hits in hit_blocks for b in hits if b.ref_cnt == 0)
    return kv.num_free_blocks - evictable_hits - reserved - watermark_blocks >= fresh
