"""Random paged batches and a dense reference, shared by the kernel tests and benchmarks.

The cache is filled by direct indexing here (not by the ops under test), and every
slot not owned by a sequence holds random values, so reading a wrong slot shows up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor            # [T, H, D]
    key_cache: torch.Tensor        # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor     # [S, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor         # [S] int32
    keys: list[torch.Tensor]       # per sequence, unpaged [seq_len, KVH, D]
    values: list[torch.Tensor]
    scale: float
    max_query_len: int
    max_seq_len: int

    def attention_args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables,
                self.query_start_loc, self.seq_lens, self.scale, self.max_query_len,
                self.max_seq_len)


def make_paged_batch(seq_lens: list[int], query_lens: list[int], num_heads: int,
                     num_kv_heads: int, head_dim: int, block_size: int,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     spare_blocks: int = 3, seed: int = 0) -> PagedBatch:
    if len(seq_lens) != len(query_lens):
        raise ValueError("query_lens: must have one entry per sequence")
    if any(q > s for q, s in zip(query_lens, seq_lens)):
        raise ValueError("query_lens: a query chunk cannot exceed its sequence length")
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq, default=0) + 1  # one extra column, like a real runner's padding
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    keys, values = [], []
    used = 0
    for seq, (seq_len, count) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = order[used:used + count]
        used += count
        block_tables[seq, :count] = ids.int()
        slots = (ids[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:seq_len]
        keys.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen))
        values.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=gen))
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = keys[-1]
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = values[-1]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)
    return PagedBatch(
        query=put(query), key_cache=put(key_cache), value_cache=put(value_cache),
        block_tables=block_tables.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        keys=[put(k) for k in keys], values=[put(v) for v in values],
        scale=head_dim ** -0.5, max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0))


def dense_attention(batch: PagedBatch, window: int | None = None, soft_cap: float | None = None,
                    dtype: torch.dtype = torch.float32,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H, D] in `dtype`, computed in float64 from the definitions on each sequence's
    unpaged K/V: causal, a query at position p sees keys p - window + 1 .. p when a window
    is given (HF's and vLLM's rule), scores s -> soft_cap * tanh(s / soft_cap) after
    scaling when a cap is (Gemma 2's). `sinks` [H] (gpt-oss): head h's softmax has one
    more logit, sinks[h] as it is (neither scaled nor capped), with no value: its weight
    only shrinks the keys' weights."""
    query = batch.query.cpu().double()
    num_heads = query.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        if end == start:
            continue
        group = num_heads // batch.keys[seq].shape[1]
        keys = batch.keys[seq].cpu().double().repeat_interleave(group, dim=1)
        values = batch.values[seq].cpu().double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end], keys) * batch.scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        query_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        allowed = key_pos <= query_pos
        if window is not None:
            allowed &= key_pos >= query_pos - window + 1
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.cpu().double()[:, None, None].expand(-1, end - start, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.to(device=batch.query.device, dtype=dtype)
