from engine.core.kv_cache.block_pool import NULL_BLOCK, BlockPool, KVBlock
from engine.core.kv_cache.events import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent,
                                    external_hash)
from engine.core.kv_cache.groups import (KVCacheGroup, KVCacheLayout, build_layout,
                                         full_attention_layout)
from engine.core.kv_cache.hashing import BlockHash, BlockHasher, update_block_hashes
from engine.core.kv_cache.manager import KVCacheManager, PrefixCacheStats

__all__ = ["AllBlocksCleared", "BlockHash", "BlockHasher", "BlockPool", "BlockRemoved",
           "BlockStored", "KVBlock", "KVCacheEvent", "KVCacheGroup", "KVCacheLayout",
           "KVCacheManager", "NULL_BLOCK", "PrefixCacheStats", "build_layout",
           "external_hash", "full_attention_layout", "update_block_hashes"]
