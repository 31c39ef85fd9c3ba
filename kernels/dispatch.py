"""The single entry point the model calls: torch on CPU, Triton on CUDA.

The Triton module is imported only for CUDA tensors, so CPU deployments never
need (or pay for importing) triton.
"""
from __future__ import annotations

import torch

from kernels import cpu_native, reference
from kernels.validation import check_paged_attention, check_reshape_and_cache


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V at its slot (block_id * block_size + offset); -1 skips."""
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    if key_cache.is_cuda:
        from kernels import triton_ops
        triton_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    elif not cpu_native.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int) -> torch.Tensor:
    """Causal attention of every sequence's query chunk over its paged K/V -> [T, H, D]."""
    check_paged_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                          seq_lens, scale, max_query_len, max_seq_len)
    if query.is_cuda:
        from kernels import triton_ops
        return triton_ops.paged_attention(query, key_cache, value_cache, block_tables,
                                          query_start_loc, seq_lens, scale, max_query_len,
                                          max_seq_len)
    return reference.paged_attention(query, key_cache, value_cache, block_tables,
                                     query_start_loc, seq_lens, scale, max_query_len,
                                     max_seq_len, decode=_cpu_decode)


def _cpu_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    out = cpu_native.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    if out is None:
        out = reference.decode_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         scale)
    return out
