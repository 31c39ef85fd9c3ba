"""Paged attention and KV-cache writes: which kernel runs each, by device, dtype and the
chunks' query x context work."""
from __future__ import annotations

import functools

import torch

from kernels.cpu import features as cpu_features
from kernels.cpu import native as cpu_native
from kernels.cpu import paged_attention as cpu_attention
from kernels import torch_invariant, torch_ops, torch_windowed
from kernels.torch_ops import attention_options
from kernels.validation import check_paged_attention, check_reshape_and_cache


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V at its slot (block_id * block_size + offset); -1 skips."""
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    if key_cache.is_cuda:
        from kernels.triton import ops as triton_ops
        triton_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    elif not cpu_native.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
        torch_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int, batch_invariant: bool = False, *,
                    sliding_window: int | None = None,
                    soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every sequence's query chunk over its paged K/V -> [T, H, D].
    `batch_invariant`: every token as a decode row (CPU; the engine refuses it on CUDA).
    `sliding_window` W: a query at position p attends to keys p - W + 1 .. p only (HF's
    and vLLM's meaning); block-table entries of blocks wholly outside every query's
    window are never read (they may name a freed placeholder). `soft_cap` c: each
    scaled logit s becomes c * tanh(s / c) before the softmax (Gemma 2). `sinks` [H]
    float32 on query's device (gpt-oss): head h's softmax takes one more logit, sinks[h]
    as it is (neither scaled nor capped), with no value (kernels/torch_windowed.py). None:
    off.

    Sinks run on the Triton kernels (CUDA) and on the torch path; on the CPU the native
    decode, tile and AMX kernels take none, so every call with sinks goes to the torch
    path there (batch-invariant: one decode call per row)."""
    check_paged_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                          seq_lens, scale, max_query_len, max_seq_len, sliding_window, soft_cap)
    _check_sinks(sinks, query)
    # Passed on only when set: today's calls (and the kernels' stand-ins in tests) keep
    # today's signatures.
    options = attention_options(sliding_window, soft_cap)
    if sinks is not None and (batch_invariant or not query.is_cuda):
        return _torch_with_sinks(query, key_cache, value_cache, block_tables, query_start_loc,
                                 seq_lens, scale, max_query_len, max_seq_len, batch_invariant,
                                 sinks, options)
    if sinks is not None:
        options = dict(options, sinks=sinks)
    if batch_invariant:
        return torch_ops.paged_attention(query, key_cache, value_cache, block_tables,
                                         query_start_loc, seq_lens, scale, max_query_len,
                                         max_seq_len, decode=_invariant_decode, rows_only=True,
                                         **options)
    if query.is_cuda:
        from kernels.triton import ops as triton_ops
        return triton_ops.paged_attention(query, key_cache, value_cache, block_tables,
                                          query_start_loc, seq_lens, scale, max_query_len,
                                          max_seq_len, **options)
    max_work = _tile_max_work(query.dtype)
    if query.dtype in _TILE_DTYPES and max_query_len > 1 and _chunks_fit_tiles(
            query_start_loc, seq_lens, max_query_len, max_seq_len, max_work, sliding_window):
        # Prefill chunks and the step's decode rows in one native call, in tiles of rows.
        out = cpu_attention.paged_attention(query, key_cache, value_cache, block_tables,
                                            query_start_loc, seq_lens, scale, **options)
        if out is not None:
            return out
    return torch_ops.paged_attention(query, key_cache, value_cache, block_tables,
                                     query_start_loc, seq_lens, scale, max_query_len,
                                     max_seq_len, decode=_cpu_decode, rows_max_work=max_work,
                                     prefill=_cpu_prefill(query.dtype), **options)


# The tile kernel's dtypes (bf16 computes in float32 there, as the decode kernel does).
_TILE_DTYPES = (torch.float32, torch.bfloat16)
# With AMX, torch's bf16 SDPA (oneDNN brgemm on the tiles) beats the tile kernel's float32
# arithmetic from small chunks on (tiles vs SDPA): 0.10 vs 0.11 ms at 64 x 64 positions,
# 0.36 vs 0.31 at 16 rows over 512, 2.5 vs 0.9 at 128 over 512, 5.4 vs 2.4 for a fresh 512
# (the decode kernel's rows, which took such chunks before: 9.1 ms there) (SmolLM2's
# 9/3 heads, one layer; amx host, 1 thread), so bf16 chunks past this much query x
# context work go to SDPA rather than to the tiles or the decode kernel's rows. Capped
# to AVX-512 BF16 on the same host the tiles still won to ~16k (1.3x at 128 x 128, 0.8x
# at 64 over 512) and to 512 x 512 at AVX2, so there bf16 keeps float32's ROWS_MAX_WORK.
BF16_AMX_TILE_MAX_WORK = 64 * 64
# Where the AMX prefill kernel is built, it takes bf16 chunks from less work still: 1.9x
# the tiles at 16 x 64 positions, 1.1x at 8 x 64 (1 thread; SmolLM2's 9/3 heads, and
# 2.0-2.7x at Llama-3.2-1B's 32/8).
BF16_AMX_PREFILL_MIN_WORK = 16 * 64


def _tile_max_work(dtype: torch.dtype) -> int:
    if dtype == torch.bfloat16 and cpu_features.detect().isa == "amx":
        if cpu_attention.prefill_amx_built():
            return BF16_AMX_PREFILL_MIN_WORK
        return BF16_AMX_TILE_MAX_WORK
    return torch_ops.ROWS_MAX_WORK


def _cpu_prefill(dtype: torch.dtype):
    # bf16 chunks on AMX: flash attention on the tiles, 2.5-3x SDPA at 128-512-token
    # prompts and 1.6-1.9x at 2,048 (SmolLM2's 9/3 heads, 1-2 threads, AMX host).
    if dtype == torch.bfloat16 and cpu_features.detect().isa == "amx":
        return cpu_attention.prefill_attention_amx
    return None


def _chunks_fit_tiles(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      max_query_len: int, max_seq_len: int, max_work: int,
                      sliding_window: int | None = None) -> bool:
    # Past ROWS_MAX_WORK a chunk runs faster through SDPA's fused kernel: 156 vs 235 ms
    # for one fresh 2048-token prompt, while the tiles took 61 vs 89 ms (4 x 512 tokens)
    # against the decode kernel's rows (SmolLM2 shapes, 1 thread, AVX2 EPYC). With a
    # window every path reads a chunk's windows alone, so that is its work.
    if max_query_len * max_seq_len <= max_work:
        return True
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    context = seq_lens.long()
    if sliding_window is not None:
        context = torch.minimum(context, query_lens + sliding_window - 1)
    return int((query_lens * context).max()) <= max_work


def _check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    if sinks is None:
        return
    heads = query.shape[1]
    if (not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32
            or tuple(sinks.shape) != (heads,) or sinks.device != query.device):
        got = (f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
               if isinstance(sinks, torch.Tensor) else type(sinks).__name__)
        raise ValueError(f"sinks: expected float32 ({heads},) (one per query head) on "
                         f"{query.device}, got {got}")


def _torch_with_sinks(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                      scale, max_query_len, max_seq_len, batch_invariant, sinks, options):
    """torch_ops' batching (the decode rows in one call, each longer chunk alone) over
    torch_windowed's kernels with the sinks bound in. Every chunk of two or more tokens
    takes the chunk kernel, whose work is O(Q x window), not the rows'."""
    decode = functools.partial(torch_windowed.decode_attention, sinks=sinks)
    if batch_invariant:
        decode = functools.partial(_each_row_alone, decode)

    def prefill(query, key_cache, value_cache, block_tables, chunk_starts, chunk_lens,
                seq_lens, scale, out, **options):
        for table, start, length, seq_len in zip(block_tables, chunk_starts.tolist(),
                                                 chunk_lens.tolist(), seq_lens.tolist()):
            out[start:start + length] = torch_windowed.prefill_attention(
                query[start:start + length], key_cache, value_cache, table, seq_len, scale,
                sinks=sinks, **options)
        return True

    return torch_ops.paged_attention(query, key_cache, value_cache, block_tables,
                                     query_start_loc, seq_lens, scale, max_query_len,
                                     max_seq_len, decode=decode, rows_only=batch_invariant,
                                     rows_max_work=0, prefill=prefill, **options)


def _each_row_alone(decode, query, key_cache, value_cache, block_tables, seq_lens, scale,
                    **options):
    # Batch-invariant: a row's call is the call it would be alone in its step (the torch
    # kernel's gathered span, and so its matmul shapes, follow the batch's longest row).
    if query.shape[0] == 0:
        return torch.empty_like(query)
    return torch.cat([decode(query[i:i + 1], key_cache, value_cache, block_tables[i:i + 1],
                             seq_lens[i:i + 1], scale, **options)
                      for i in range(query.shape[0])])


def _cpu_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, **options):
    # The CPU prefill path stays torch (SDPA's fused kernel); only decode rows, and short
    # chunks run as rows (torch_ops.ROWS_MAX_WORK), take the C kernel.
    out = cpu_native.decode_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                      scale, **options)
    if out is None:
        out = torch_ops.decode_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         scale, **options)
    return out


def _invariant_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, **options):
    # The C kernel is one row's online softmax over its blocks, whatever the batch.
    out = cpu_native.decode_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                      scale, **options)
    if out is None:
        out = torch_invariant.decode_attention(query, key_cache, value_cache, block_tables,
                                               seq_lens, scale, **options)
    return out


def warm_up(key_cache: torch.Tensor, num_heads: int, max_model_len: int,
            max_num_batched_tokens: int) -> None:
    """Compile the device kernels' variants before serving (CUDA: kernels/triton/warmup);
    the CPU kernels are built ahead and need nothing."""
    if key_cache.is_cuda:
        from kernels.triton import warmup as triton_warmup
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        triton_warmup.warm_up_attention(num_heads, num_kv_heads, head_dim, block_size,
                                        key_cache.dtype, key_cache.device, max_model_len,
                                        max_num_batched_tokens)
