"""The KV pool on a GPU: what gpu_memory_utilization leaves once the weights and the
largest step's activations are in (vLLM's profile run), instead of a fixed size."""
from __future__ import annotations

import torch

from engine.models import AttentionMetadata
from engine.models.loader import LoadedModel

GiB = 1024**3


def kv_pool_bytes(total: int, share: float, peak_torch: int, non_torch: int) -> int:
    """share x total, less the torch peak of a profiled step (weights included) and what
    others hold on the device (the CUDA context, other processes)."""
    pool = int(share * total) - peak_torch - non_torch
    if pool <= 0:
        raise ValueError(
            f"gpu_memory_utilization={share} of the device's {total / GiB:.1f} GiB leaves "
            f"nothing for the KV cache: the weights and the largest step take "
            f"{peak_torch / GiB:.2f} GiB, the CUDA context and other processes "
            f"{non_torch / GiB:.2f} GiB; raise gpu_memory_utilization, lower "
            f"max_num_batched_tokens, or give kv_cache_memory_bytes")
    return pool


@torch.inference_mode()
def profile_kv_pool_bytes(loaded: LoadedModel, share: float, max_num_batched_tokens: int,
                          max_num_seqs: int, block_size: int) -> int:
    """Run one step of max_num_batched_tokens prompt tokens (and the logits of
    max_num_seqs rows) on a pool just big enough for it, and size the real pool from
    the peak. The device must hold only this model so far."""
    model = loaded.model
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = total - free - torch.cuda.memory_reserved(device)

    tokens = max_num_batched_tokens
    num_blocks = -(-tokens // block_size)
    shape = (num_blocks, block_size, loaded.num_kv_heads, loaded.head_dim)
    kv_caches = [(torch.zeros(shape, dtype=loaded.dtype, device=device),
                  torch.zeros(shape, dtype=loaded.dtype, device=device))
                 for _ in range(loaded.num_layers)]
    profile_kv = 2 * loaded.num_layers * kv_caches[0][0].numel() * kv_caches[0][0].element_size()
    arange = torch.arange(tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=arange, block_tables=torch.arange(num_blocks, dtype=torch.int32,
                                                       device=device)[None],
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        max_query_len=tokens, max_seq_len=tokens)
    hidden = model(torch.zeros(tokens, dtype=torch.int64, device=device),
                   arange % loaded.max_position_embeddings, kv_caches, meta)
    logits = model.compute_logits(hidden[:min(tokens, max_num_seqs)])
    torch.softmax(logits, dim=-1)  # the sampler's largest temporaries are vocab-sized too
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - profile_kv
    del hidden, logits, kv_caches
    torch.cuda.empty_cache()
    return kv_pool_bytes(total, share, peak, non_torch)
