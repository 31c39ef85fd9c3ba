"""Paged attention for query chunks of any length (prefill, chunked prefill, prefix hits).

Grid (sequence, KV head, query tile). A tile holds BLOCK_Q consecutive query tokens
times all GROUP query heads of one KV head, as BLOCK_M = BLOCK_Q * GROUP_P2 rows, so
K/V tiles are shared across the group. Keys come from the paged cache (the chunk's
own K/V was written there first) and stop at the tile's last query position; the
causal mask is aligned bottom-right: query j sits at seq_len - query_len + j.

sliding_window W > 0: query p sees keys p - W + 1 .. p; keys start at the tile's first
row's lowest, and nothing before it is loaded (masked loads read nothing).
soft_cap_log2 > 0: logits capped (common.soft_cap). Each row's online softmax starts from
its head's sink, sinks_ptr[head] (common.sink_logits; -inf: none).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.common import (dot, load_kv_tile, online_softmax_update, sink_logits,
                                   soft_cap)


@triton.jit(do_not_specialize=["block_table_stride", "sliding_window"])  # as decode's
def prefill_attention_kernel(
        query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr,
        seq_lens_ptr, out_ptr, scale_log2, query_stride_token, query_stride_head,
        block_table_stride, sliding_window, soft_cap_log2, sinks_ptr,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
        GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        FP32_DOT: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    first_row = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - first_row
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    tokens = q_tile * BLOCK_Q + rows // GROUP_P2
    groups = rows % GROUP_P2
    heads = kv_head * GROUP + groups
    dims = tl.arange(0, DIM_P2)
    row_valid = (tokens < query_len) & (groups < GROUP)
    io_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    io_rows = (first_row + tokens).to(tl.int64)
    query = tl.load(query_ptr + io_rows[:, None] * query_stride_token
                    + heads[:, None] * query_stride_head + dims[None, :], mask=io_mask, other=0.0)
    query_positions = context_len + tokens
    table_row = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    # Keys past the tile's last query token are never attended.
    kv_end = context_len + tl.minimum(query_len, (q_tile + 1) * BLOCK_Q)
    # Keys before the tile's first query's window neither (every key without one): a
    # window past every position (padding rows' too) stands for none.
    window = tl.where(sliding_window > 0, sliding_window, 1 << 30)
    lowest = tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0)

    running_max = sink_logits(sinks_ptr, heads, groups < GROUP)
    running_sum = tl.where(running_max > float("-inf"), 1.0, 0.0)
    acc = tl.zeros([BLOCK_Q * GROUP_P2, DIM_P2], tl.float32)
    # With a window a row may see no key of the first tiles: online_softmax_update keeps
    # such a row at zero weight until its keys come.
    for tile_start in range(lowest // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        valid = (positions >= lowest) & (positions < kv_end)
        keys = load_kv_tile(key_cache_ptr, table_row, positions, valid, kv_head, dims,
                            BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        scores = dot(query, tl.trans(keys), FP32_DOT) * scale_log2
        if soft_cap_log2 > 0:
            scores = soft_cap(scores, soft_cap_log2)
        allowed = valid[None, :] & (positions[None, :] <= query_positions[:, None])
        allowed = allowed & (positions[None, :] > query_positions[:, None] - window)
        scores = tl.where(allowed, scores, float("-inf"))
        values = load_kv_tile(value_cache_ptr, table_row, positions, valid, kv_head, dims,
                              BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        acc, running_max, running_sum = online_softmax_update(scores, values, acc, running_max,
                                                              running_sum, FP32_DOT)
    # Padding rows (past the chunk) may see no key in a window: 0, not 0 / 0; they are
    # not stored.
    acc = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(out_ptr + (io_rows[:, None] * NUM_HEADS + heads[:, None]) * HEAD_DIM + dims[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=io_mask)
