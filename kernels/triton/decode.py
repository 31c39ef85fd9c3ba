"""Split-K paged decode attention (flash-decoding): one query token per sequence.

Grid (sequence, KV head, partition). Each program handles every query head of its KV
group at once (GQA: K/V tiles are read once per group) over one partition of the
context. With several partitions a second kernel merges the partial results using
each partition's running max and sum of exponentials, so a small batch with long
contexts still spreads over the whole GPU.

sliding_window W > 0: the row at seq_len - 1 sees keys seq_len - W .. seq_len - 1; keys
before that are never loaded (masked loads read nothing), partitions wholly before it
return at once and the reduce skips them. soft_cap_log2 > 0: logits capped (common.soft_cap).
sinks_ptr[head] joins each head's softmax (common.sink_logits; -inf: none); unsplit, the
program starts from it, split, the reduce adds it once to the partitions' sums.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.common import (dot, load_kv_tile, online_softmax_update, sink_logits,
                                   soft_cap)


# Ints that follow the batch (block-table width, partition count and size) or the layer
# (its window) are not specialized on (Triton would compile variants for == 1 and
# % 16 == 0): the compiled set stays the one the start-up warm-up covers
# (kernels/triton/warmup.py). The soft cap is a runtime float for the same reason.
@triton.jit(do_not_specialize=["block_table_stride", "num_partitions", "partition_size",
                               "sliding_window"])
def decode_partition_kernel(
        query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr,
        seq_lens_ptr, out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
        scale_log2, query_stride_token, query_stride_head, block_table_stride, num_partitions,
        partition_size, sliding_window, soft_cap_log2, sinks_ptr,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
        GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
        FP32_DOT: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    row = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - row
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition_size
    lowest = window_start(seq_len, sliding_window)
    # Partitions past the end or before the window are skipped; the reduce kernel ignores
    # them via seq_len and the window.
    if (query_len == 0) | (start >= seq_len) | (start + partition_size <= lowest):
        return
    end = tl.minimum(start + partition_size, seq_len)
    # The first tile holding a key in the window: no tile is all masked (nor all -inf).
    first_tile = start + (tl.maximum(lowest, start) - start) // BLOCK_N * BLOCK_N

    groups = tl.arange(0, GROUP_P2)
    dims = tl.arange(0, DIM_P2)
    heads = kv_head * GROUP + groups
    head_mask = (groups < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    query = tl.load(query_ptr + row.to(tl.int64) * query_stride_token
                    + heads[:, None] * query_stride_head + dims[None, :], mask=head_mask, other=0.0)
    table_row = block_tables_ptr + seq.to(tl.int64) * block_table_stride

    running_max = tl.full([GROUP_P2], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_P2], tl.float32)
    if not SPLIT:  # split, the reduce adds the sink, once over all partitions
        running_max = sink_logits(sinks_ptr, heads, groups < GROUP)
        running_sum = tl.where(running_max > float("-inf"), 1.0, 0.0)
    acc = tl.zeros([GROUP_P2, DIM_P2], tl.float32)
    for tile_start in range(first_tile, end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        valid = (positions >= lowest) & (positions < end)
        keys = load_kv_tile(key_cache_ptr, table_row, positions, valid, kv_head, dims,
                            BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        # log2-domain logits: exp2 is the native instruction
        scores = dot(query, tl.trans(keys), FP32_DOT) * scale_log2
        if soft_cap_log2 > 0:
            scores = soft_cap(scores, soft_cap_log2)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        values = load_kv_tile(value_cache_ptr, table_row, positions, valid, kv_head, dims,
                              BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        acc, running_max, running_sum = online_softmax_update(scores, values, acc, running_max,
                                                              running_sum, FP32_DOT)
    acc = acc / running_sum[:, None]

    if not SPLIT:
        tl.store(out_ptr + (row.to(tl.int64) * NUM_HEADS + heads[:, None]) * HEAD_DIM
                 + dims[None, :], acc.to(out_ptr.dtype.element_ty), mask=head_mask)
    else:
        slot = (seq.to(tl.int64) * NUM_HEADS + heads) * num_partitions + part
        tl.store(part_out_ptr + slot[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_mask)
        tl.store(part_max_ptr + slot, running_max, mask=groups < GROUP)
        tl.store(part_sum_ptr + slot, running_sum, mask=groups < GROUP)


@triton.jit
def window_start(seq_len, sliding_window):
    """The first key the decode row (at seq_len - 1) sees: 0 without a window (<= 0)."""
    return tl.maximum(seq_len - tl.where(sliding_window > 0, sliding_window, seq_len), 0)


@triton.jit(do_not_specialize=["num_partitions", "partition_size", "sliding_window"])
def decode_reduce_kernel(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr,
                         seq_lens_ptr, num_partitions, partition_size, sliding_window,
                         sinks_ptr,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
                         PARTS_P2: tl.constexpr):
    """Grid (sequence, head): softmax-weighted merge of the partition outputs.

    num_partitions and partition_size are runtime values (they follow the batch every
    step) so they do not recompile; only the count's power-of-two bucket PARTS_P2 is.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == row:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, partition_size)
    skipped = window_start(seq_len, sliding_window) // partition_size
    parts = tl.arange(0, PARTS_P2)
    dims = tl.arange(0, DIM_P2)
    in_use = (parts < used) & (parts >= skipped)
    slot = (seq.to(tl.int64) * NUM_HEADS + head) * num_partitions + parts
    part_max = tl.load(part_max_ptr + slot, mask=in_use, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + slot, mask=in_use, other=0.0)
    # The sink is one more term of the denominator (0 without one: exp2(-inf)).
    sink = sink_logits(sinks_ptr, head, head < NUM_HEADS)
    top = tl.maximum(tl.max(part_max, axis=0), sink)
    weights = tl.exp2(part_max - top) * part_sum
    weights = weights / (tl.sum(weights, axis=0) + tl.exp2(sink - top))
    partial = tl.load(part_out_ptr + slot[:, None] * HEAD_DIM + dims[None, :],
                      mask=in_use[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    merged = tl.sum(partial * weights[:, None], axis=0)
    tl.store(out_ptr + (row.to(tl.int64) * NUM_HEADS + head) * HEAD_DIM + dims,
             merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
