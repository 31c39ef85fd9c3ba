"""Batch-wide attention metadata and the paged attention layer.

A forward covers a flat token dimension [T] mixing prefill chunks and decodes; the
metadata says which rows belong to which sequence and where their K/V live in the cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.dispatch import paged_attention, reshape_and_cache


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [T] int64: cache slot of each token; -1 = padding
    block_tables: torch.Tensor     # [S, max_blocks] int32
    query_start_loc: torch.Tensor  # [S + 1] int32: sequence i owns rows qsl[i]:qsl[i+1]
    seq_lens: torch.Tensor         # [S] int32: context length including this step's tokens
    max_query_len: int
    max_seq_len: int


def per_layer(meta: "AttentionMetadata | list[AttentionMetadata]",
              num_layers: int) -> list[AttentionMetadata]:
    """What a model's forward takes as `meta`, one entry per layer: a single
    AttentionMetadata is read by every layer; a list has one per layer, where layers
    keep their K/V in different block tables (the KV-cache manager's groups of
    full-attention and sliding-window layers)."""
    if isinstance(meta, AttentionMetadata):
        return [meta] * num_layers
    if len(meta) != num_layers:
        raise ValueError(f"attention metadata: expected {num_layers} layers, got {len(meta)}")
    return meta


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over the whole context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        # Set by LlamaForCausalLM.prepack: every token attends as its own row.
        self.batch_invariant = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                scale: float | None = None, sliding_window: int | None = None,
                soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]. `scale` (None: head_dim ** -0.5),
        `sliding_window`, `soft_cap` and `sinks` (kernels.dispatch.paged_attention's) come
        from the model's attention module, which owns them: tensor-parallel sharding
        replaces this module with a bare one for the rank's heads
        (engine/distributed/sharding.py)."""
        key_cache, value_cache = kv_cache
        reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        return paged_attention(q, key_cache, value_cache, meta.block_tables,
                               meta.query_start_loc, meta.seq_lens,
                               self.scale if scale is None else scale,
                               meta.max_query_len, meta.max_seq_len, self.batch_invariant,
                               sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
