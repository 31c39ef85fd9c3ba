"""Triton kernel writing new tokens' K/V into the paged cache."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                             key_stride_token, key_stride_head, value_stride_token,
                             value_stride_head,
                             NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                             HEADS_P2: tl.constexpr, DIM_P2: tl.constexpr):
    """One program per token: copy its [KVH, D] K and V to row `slot` of the cache."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, DIM_P2)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    cache_offsets = (slot * NUM_KV_HEADS + heads) * HEAD_DIM + dims
    key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims,
                    mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)
