"""Compile every Triton kernel variant a server can meet, before it serves.

A variant is what the launchers compile in: for decode, whether the context is split
and the reduce kernel's power-of-two partition bucket; for prefill, the query tile
BLOCK_Q. Everything else that follows the batch is a runtime argument the kernels do
not specialize on. Without this, the first batch of a new shape stalls every request in
it for a JIT compile (seconds on a GPU), possibly long after start-up.
"""
from __future__ import annotations

import dataclasses

import torch
import triton

from kernels.triton.ops import (DEFAULT_TILES, MIN_PARTITION_SIZE, AttentionTiles,
                                paged_attention, plan_decode, prefill_block_q,
                                reshape_and_cache)


def variant(num_seqs: int, num_kv_heads: int, group: int, max_query_len: int,
            max_seq_len: int, sms: int, tiles: AttentionTiles = DEFAULT_TILES) -> tuple:
    """The compiled-in choice paged_attention makes for this batch on a device with
    `sms` streaming multiprocessors."""
    if max_query_len == 1:
        plan = plan_decode(num_seqs, num_kv_heads, max_seq_len, sms, tiles)
        return ("decode", plan.parts_p2)
    return ("prefill", prefill_block_q(group, max_query_len, tiles))


@dataclasses.dataclass(frozen=True, slots=True)
class WarmUpCase:
    key: tuple
    max_query_len: int
    seq_len: int
    tiles: AttentionTiles


def warm_up_cases(group: int, max_model_len: int, max_num_batched_tokens: int,
                  tiles: AttentionTiles = DEFAULT_TILES) -> list[WarmUpCase]:
    """One small launch per variant reachable within these limits (a superset: every
    power-of-two partition bucket up to the most partitions a sequence can have).
    Decode cases fix the partition size at block_n, the smallest, so a few keys give
    any partition count; the variant does not depend on the size."""
    cases = [WarmUpCase(("decode", 0), 1, 1, tiles)]
    smallest = tiles.partition_size or max(MIN_PARTITION_SIZE, tiles.block_n)
    most_parts = triton.cdiv(max_model_len, smallest)
    split_tiles = dataclasses.replace(tiles, partition_size=tiles.block_n)
    parts = 2
    while parts <= triton.next_power_of_2(most_parts):
        cases.append(WarmUpCase(("decode", parts), 1, parts * tiles.block_n, split_tiles))
        parts *= 2
    longest_chunk = min(max_num_batched_tokens, max_model_len)
    seen = set()
    query_len = 2
    while query_len // 2 < longest_chunk:
        length = min(query_len, longest_chunk)
        block_q = prefill_block_q(group, length, tiles)
        if block_q not in seen:
            seen.add(block_q)
            cases.append(WarmUpCase(("prefill", block_q), length, length, tiles))
        query_len *= 2
    return cases


def warm_up_attention(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                      dtype: torch.dtype, device: torch.device, max_model_len: int,
                      max_num_batched_tokens: int, tiles: AttentionTiles = DEFAULT_TILES
                      ) -> list[WarmUpCase]:
    """Run every case of warm_up_cases on a one-block dummy cache: block tables of
    zeros send every position to block 0, so a long context needs no memory."""
    key_cache = torch.zeros(1, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    cases = warm_up_cases(num_heads // num_kv_heads, max_model_len, max_num_batched_tokens, tiles)
    for case in cases:
        tokens = case.max_query_len
        query = torch.zeros(tokens, num_heads, head_dim, dtype=dtype, device=device)
        new_kv = torch.zeros(tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
        slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        reshape_and_cache(new_kv, new_kv, key_cache, value_cache, slots)
        width = triton.cdiv(case.seq_len, block_size)
        paged_attention(query, key_cache, value_cache,
                        torch.zeros(1, width, dtype=torch.int32, device=device),
                        torch.tensor([0, tokens], dtype=torch.int32, device=device),
                        torch.tensor([case.seq_len], dtype=torch.int32, device=device),
                        head_dim ** -0.5, tokens, case.seq_len, case.tiles)
    return cases
