"""Small Triton helpers shared by the attention kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, FP32_DOT: tl.constexpr):
    """tl.dot with fp32 operands and exact products when FP32_DOT is set.

    FP32_DOT is used for fp32 caches (so the GPU does not silently drop to TF32) and
    under TRITON_INTERPRET=1, whose bf16 tl.dot returns garbage (seen on triton 3.9).
    Callers round probabilities to the value dtype before calling, so the interpreter
    sees the same rounded operands the GPU multiplies.
    """
    if FP32_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def load_kv_tile(cache_ptr, block_table_row_ptr, positions, valid, kv_head, dims,
                 BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[len(positions), DIM_P2] K or V rows of one KV head, read through the block table.

    Every position resolves its own block id, so a tile may span several pages and
    any block_size works; masked positions read nothing and come back as 0.
    """
    block_ids = tl.load(block_table_row_ptr + positions // BLOCK_SIZE, mask=valid, other=0)
    rows = (block_ids.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE) * NUM_KV_HEADS + kv_head
    mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
    return tl.load(cache_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)


@triton.jit
def soft_cap(scores, cap):
    """cap * tanh(scores / cap), scores and cap in one unit (the kernels' log2 domain: a
    cap c on natural logits is c * log2(e) there, as tanh's argument is a ratio).
    tanh(x) = 1 - 2 / (1 + e^2x): e^2x overflowing to inf gives 1, underflowing -1."""
    e = tl.exp2(scores * (2.8853900817779268 / cap))  # 2 log2(e) / cap
    return cap * (1.0 - 2.0 / (1.0 + e))


@triton.jit
def sink_logits(sinks_ptr, heads, valid):
    """Each row's attention sink (gpt-oss: a logit in its head's softmax with no value) in
    the kernels' log2 units; -inf is none (a model without sinks passes -inf for every
    head) and so are padding rows. A row's online softmax starts from it: running max =
    the sink, running sum = e^0 = 1, and a -inf sink starts it empty, as without sinks."""
    sink = tl.load(sinks_ptr + heads, mask=valid, other=float("-inf"))
    return sink * 1.4426950408889634  # log2(e)


@triton.jit
def online_softmax_update(scores, values, acc, running_max, running_sum, FP32_DOT: tl.constexpr):
    """Fold one tile of (log2-domain, already masked) scores and its V rows into the
    running max / sum / weighted accumulator of flash attention. A row with no key yet
    (all -inf so far: before its sliding window) subtracts 0 instead of its -inf max,
    which keeps its weights and correction 0 rather than NaN; any other row is as before."""
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    probs = tl.exp2(scores - safe_max[:, None])
    correction = tl.exp2(running_max - safe_max)
    running_sum = running_sum * correction + tl.sum(probs, axis=1)
    acc = acc * correction[:, None] + dot(probs.to(values.dtype), values, FP32_DOT)
    return acc, new_max, running_sum
