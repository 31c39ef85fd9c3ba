"""What the prefix cache tells outside indexers: vLLM's KV-cache events.

A hash enters the cache (BlockStored), leaves it (BlockRemoved), or the whole cache is
forgotten (AllBlocksCleared). The KV manager records them as they happen; the engine
hands each step's list to the publisher (engine/core/kv_cache/publisher.py), which owns the wire
format. Events describe the set of hashes a lookup can hit: a block holding the same
tokens as a cached one is not announced, and a hash is removed only when no block
serves it any more.

Models with several KV-cache groups (engine/core/kv_cache/groups.py) cache each group's
blocks on their own, so every BlockStored / BlockRemoved names its group (vLLM's
group_idx: the group's index, 0 for a model of one group). A windowed group's
BlockStored also says so (kv_cache_spec_kind "sliding_window" and the window, the fields
newer vLLM publishes), since it drops blocks behind its window while the request runs:
an indexer that knows the window counts a prefix as cached when the window's blocks
before its end are (the engine's own hit rule); one that does not sees those removals
and merely under-counts."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.core.kv_cache.hashing import BlockHash

# vLLM names the engine's own KV tier "GPU" whatever the device; its CPU build does too.
MEDIUM = "GPU"
# The group of a model with one KV-cache group.
GROUP_IDX = 0
_MASK64 = (1 << 64) - 1


def external_hash(block_hash: BlockHash) -> int | bytes:
    """vLLM's rule (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, default on): publish the low 64
    bits of the digest, read big-endian, as an unsigned integer; raw bytes when off."""
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    if os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") == "0":
        return block_hash
    return int.from_bytes(block_hash, "big") & _MASK64


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM
    # One entry per block, as vLLM 0.32 publishes them: the block's hash extra keys
    # untagged (the adapter's name, the bare cache_salt on a salted prompt's first block),
    # else None.
    extra_keys: list[tuple | None] | None = None
    # vLLM's: the request's LoRA adapter (id, deprecated there, and name); None: the base.
    lora_id: int | None = None
    lora_name: str | None = None
    group_idx: int = GROUP_IDX
    # The group's window (None: full attention), published only when set.
    sliding_window: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash] = field(default_factory=list)
    medium: str = MEDIUM
    group_idx: int = GROUP_IDX


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
