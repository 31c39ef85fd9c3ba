"""CacheConfig: the paged KV cache's block size, pool size and prefix caching."""
from __future__ import annotations

from dataclasses import dataclass

from engine.config.checks import check_positive

# Block-hash functions (engine/core/kv_cache/hashing.py implements them): "builtin" is
# Python's hash(); the others are vLLM 0.32's, with which an outside indexer recomputes
# keys from tokens (the xxhash ones need PYTHONHASHSEED set alike on both sides).
HASH_ALGOS = ("builtin", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    # None: derived from kv_cache_memory_bytes once the model shape is known.
    num_kv_blocks: int | None = None
    # None: 2 GiB on a CPU; on a GPU what gpu_memory_utilization leaves once the weights
    # and a profiled forward are in (engine/worker/kv_pool.py sizes the pool).
    kv_cache_memory_bytes: int | None = None
    # vLLM's meaning: the share of the GPU's memory this engine may use in all (weights,
    # activations, KV pool). None: 0.9. Ignored on a CPU, as vLLM's CPU backend does.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # vLLM's name. "builtin" (Python's hash(), the fast default) or, for block hashes an
    # outside indexer can recompute from tokens, vLLM's "sha256" / "sha256_cbor" /
    # "xxhash" / "xxhash_cbor" (engine/core/kv_cache/hashing.py; xxhash needs the xxhash
    # package).
    prefix_caching_hash_algo: str = "builtin"
    # Fraction of all blocks kept free when admitting new or resumed requests.
    watermark: float = 0.0

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.num_kv_blocks is not None:
            check_positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_bytes is not None:
            check_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                             f"got {self.prefix_caching_hash_algo!r}")

    @property
    def explicit_pool(self) -> bool:
        return self.num_kv_blocks is not None or self.kv_cache_memory_bytes is not None

    @property
    def watermark_blocks(self) -> int:
        assert self.num_kv_blocks is not None
        return int(self.watermark * self.num_kv_blocks)
