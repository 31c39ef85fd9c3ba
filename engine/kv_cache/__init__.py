from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.hashing import hash_block, update_block_hashes
from engine.kv_cache.manager import KVCacheManager, PrefixCacheStats

__all__ = ["BlockPool", "KVBlock", "KVCacheManager", "PrefixCacheStats", "hash_block",
           "update_block_hashes"]
