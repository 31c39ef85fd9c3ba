"""How many KV blocks the engine gets, and how long a request may be: the one place that
sizes the pool, from an explicit block count, a byte budget, or (on a GPU) what
gpu_memory_utilization leaves after the weights and a profiled step."""
from __future__ import annotations

import dataclasses
import logging

from engine.config import EngineConfig

logger = logging.getLogger(__name__)

# The KV pool on a CPU when no size is given (vLLM's CPU backend takes
# VLLM_CPU_KVCACHE_SPACE, 4 GiB by default; a 2-core host rarely fills 2).
CPU_KV_CACHE_BYTES = 2 * 1024**3
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def resolve_kv_pool(config: EngineConfig, loaded) -> EngineConfig:
    """Fill in what depends on the model (max_model_len, num_kv_blocks) and refuse a
    configuration that cannot serve one request of max_model_len."""
    sched, cache = config.scheduler, config.cache
    max_model_len = sched.max_model_len or loaded.max_position_embeddings
    if max_model_len > loaded.max_position_embeddings:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({loaded.max_position_embeddings})")
    num_blocks = cache.num_kv_blocks
    if num_blocks is None:
        per_block = loaded.kv_cache_bytes_per_token() * cache.block_size
        num_blocks = pool_bytes(config, loaded) // per_block
    needed = -(-max_model_len // cache.block_size)
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
