"""Paged batches whose freed blocks hold NaN, and a dense float64 reference of windowed,
soft-capped attention with or without sinks, for the window / soft-cap / sinks tests of
every attention path.

The reference is testing/paged_batch.py's dense_attention in float64: written from the
definitions on each sequence's unpaged K/V, sharing nothing with kernels/.
"""
from __future__ import annotations

import torch

from testing.paged_batch import PagedBatch, dense_attention, make_paged_batch


def windowed_batch(seq_lens: list[int], query_lens: list[int], num_heads: int,
                   num_kv_heads: int, head_dim: int, block_size: int,
                   window: int | None, dtype: torch.dtype = torch.float32, seed: int = 0,
                   scale: float | None = None, query_gain: float = 1.0,
                   device: str = "cpu") -> PagedBatch:
    """make_paged_batch, then one more block full of NaN (the placeholder a KV manager
    leaves where it freed a block) named by every table entry a kernel must not read:
    blocks wholly before the union of a sequence's query windows, and the padding past
    its own blocks. Any such read that reaches P @ V or the output turns it NaN."""
    batch = make_paged_batch(seq_lens, query_lens, num_heads, num_kv_heads, head_dim,
                             block_size, dtype=dtype, seed=seed)
    placeholder = batch.key_cache.shape[0]
    nan_block = torch.full((1, *batch.key_cache.shape[1:]), float("nan"), dtype=dtype)
    batch.key_cache = torch.cat([batch.key_cache, nan_block])
    batch.value_cache = torch.cat([batch.value_cache, nan_block])
    tables = batch.block_tables.clone()
    for seq, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        used = -(-seq_len // block_size)
        tables[seq, used:] = placeholder
        if window is not None and query_len > 0:
            lowest = max(0, seq_len - query_len - window + 1)
            tables[seq, :lowest // block_size] = placeholder
    batch.block_tables = tables
    if scale is not None:
        batch.scale = scale
    if query_gain != 1.0:  # larger logits, so that a soft cap changes them a lot
        batch.query = (batch.query.float() * query_gain).to(dtype)
    for name in ("query", "key_cache", "value_cache", "block_tables", "query_start_loc",
                 "seq_lens"):
        setattr(batch, name, getattr(batch, name).to(device))
    return batch


def reference(batch: PagedBatch, window: int | None, soft_cap: float | None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [T, H, D]: each sequence's chunk against its unpaged K/V, dense, on CPU."""
    return dense_attention(batch, window, soft_cap, torch.float64, sinks).cpu()


def assert_matches(got: torch.Tensor, batch: PagedBatch, window: int | None,
                   soft_cap: float | None, atol: float, rtol: float,
                   sinks: torch.Tensor | None = None) -> None:
    """got against the reference, which must itself differ from what ignoring the cap, the
    sinks, or a window shorter than some context, gives (else the case would not test
    them)."""
    assert got is not None and got.dtype == batch.query.dtype
    assert got.shape == batch.query.shape
    assert not torch.isnan(got.float()).any(), "read a freed (NaN) block"
    expected = reference(batch, window, soft_cap, sinks)
    torch.testing.assert_close(got.cpu().double(), expected, atol=atol, rtol=rtol)
    lengths = [n for n, q in zip(batch.seq_lens.tolist(), batch.query_start_loc.diff().tolist())
               if q > 0]
    if window is not None and window < max(lengths, default=0):
        assert (reference(batch, None, soft_cap, sinks) - expected).abs().max() > 10 * atol
    if soft_cap is not None:
        assert (reference(batch, window, None, sinks) - expected).abs().max() > 10 * atol
    if sinks is not None:
        assert (reference(batch, window, soft_cap) - expected).abs().max() > 10 * atol
