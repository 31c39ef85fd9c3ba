"""How many KV blocks the engine gets, and how long a request may be: the one place that
sizes the pool, from an explicit block count, a byte budget, or (on a GPU) what
gpu_memory_utilization leaves after the weights and a profiled step.

A block holds `group_size` layers' K and V (engine/core/kv_cache/groups.py): every layer
for a model of one KV-cache group, fewer for a hybrid one, whose groups each take their
own blocks. A request of max_model_len must fit alone: every block of its full-attention
groups, a window plus a step's tokens of its windowed ones."""
from __future__ import annotations

import dataclasses
import logging

from engine.config import EngineConfig
from engine.core.kv_cache.groups import KVCacheLayout, build_layout

logger = logging.getLogger(__name__)

# The KV pool on a CPU when no size is given (vLLM's CPU backend takes
# VLLM_CPU_KVCACHE_SPACE, 4 GiB by default; a 2-core host rarely fills 2).
CPU_KV_CACHE_BYTES = 2 * 1024**3
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def kv_layout(loaded) -> KVCacheLayout:
    """The loaded model's KV-cache groups, from its layers' windows (none known: every
    layer full attention)."""
    return build_layout(loaded.sliding_windows or [None] * loaded.num_layers)


def kv_block_bytes(loaded, layout: KVCacheLayout, block_size: int) -> int:
    """One block: K and V of block_size tokens in group_size layers."""
    per_layer_token = loaded.kv_cache_bytes_per_token() // loaded.num_layers
    return per_layer_token * layout.group_size * block_size


def resolve_kv_pool(config: EngineConfig, loaded, layout: KVCacheLayout | None = None,
                    draft_block_bytes: int = 0) -> EngineConfig:
    """Fill in what depends on the model (max_model_len, num_kv_blocks) and refuse a
    configuration that cannot serve one request of max_model_len. `layout`: the model's
    KV-cache groups (default: kv_layout(loaded)). A draft model (speculative decoding)
    keeps its K/V in the same blocks: `draft_block_bytes` more per block (its lookahead
    slots end at max_model_len, so a request still needs no more blocks)."""
    sched, cache = config.scheduler, config.cache
    layout = layout or kv_layout(loaded)
    context = loaded.max_position_embeddings
    max_model_len = sched.max_model_len or context
    if max_model_len > context:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's context "
                         f"({_context_source(config, loaded)})")
    num_blocks = cache.num_kv_blocks
    if num_blocks is None:
        num_blocks = pool_bytes(config, loaded) // (
            kv_block_bytes(loaded, layout, cache.block_size) + draft_block_bytes)
    needed = layout.peak_blocks(max_model_len, cache.block_size, sched.max_num_batched_tokens)
    usable = num_blocks - int(cache.watermark * num_blocks)
    if usable < needed:
        raise ValueError(
            f"KV cache too small: {num_blocks} blocks of {cache.block_size} tokens "
            f"(watermark {cache.watermark}) cannot hold one request of max_model_len="
            f"{max_model_len} ({needed} blocks); raise num_kv_blocks / "
            f"kv_cache_memory_bytes or lower max_model_len")
    return dataclasses.replace(
        config,
        scheduler=dataclasses.replace(sched, max_model_len=max_model_len),
        cache=dataclasses.replace(cache, num_kv_blocks=num_blocks))


def _context_source(config: EngineConfig, loaded) -> str:
    """Where the model's context limit comes from, for the error that names it."""
    context = loaded.max_position_embeddings
    positions = getattr(loaded.hf_config, "max_position_embeddings", context)
    if config.disable_sliding_window and context < positions:
        return (f"{context} tokens: its sliding window, as disable_sliding_window caps it; "
                f"max_position_embeddings {positions}")
    return f"max_position_embeddings {context}"


def pool_bytes(config: EngineConfig, loaded) -> int:
    cache, device = config.cache, config.torch_device
    if cache.gpu_memory_utilization is not None and (cache.explicit_pool
                                                     or not device.startswith("cuda")):
        why = "the KV pool's size is given" if cache.explicit_pool else (
            f"on {device}, as vLLM's CPU backend ignores it")
        logger.info("gpu_memory_utilization ignored: %s", why)
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    if not device.startswith("cuda"):
        return CPU_KV_CACHE_BYTES
    from engine.worker.gpu_memory import profile_kv_pool_bytes
    share = cache.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    sched = config.scheduler
    pool = profile_kv_pool_bytes(loaded, share, sched.max_num_batched_tokens,
                                 sched.max_num_seqs, cache.block_size)
    logger.info("KV pool %.2f GiB: gpu_memory_utilization %s of %s after the weights "
                "and a profiled %d-token step", pool / 1024**3, share, device,
                sched.max_num_batched_tokens)
    return pool
