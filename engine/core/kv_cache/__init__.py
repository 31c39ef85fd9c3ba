from engine.core.kv_cache.block_pool import BlockPool, KVBlock
from engine.core.kv_cache.events import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent,
                                    external_hash)
from engine.core.kv_cache.hashing import BlockHash, BlockHasher, update_block_hashes
from engine.core.kv_cache.manager import KVCacheManager, PrefixCacheStats

__all__ = ["AllBlocksCleared", "BlockHash", "BlockHasher", "BlockPool", "BlockRemoved",
           "BlockStored", "KVBlock", "KVCacheEvent", "KVCacheManager",
           "PrefixCacheStats", "external_hash", "update_block_hashes"]
