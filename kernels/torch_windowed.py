"""Torch attention with a sliding window, logit soft-capping and/or attention sinks
(Gemma 2/3, Mistral, Phi-3, gpt-oss): the semantics every faster path of these features
is tested against, and what runs wherever such a path declines. kernels/torch_ops.py
sends its calls here when a window or a cap is set, so its own arithmetic (and bits) are
unchanged without them; kernels.dispatch sends every call with sinks here.

Window W: a query at position p sees keys p - W + 1 .. p (W keys, itself included).
Soft cap c: each scaled logit s becomes c * tanh(s / c) before the softmax.
Sinks [H] float32 (gpt-oss): head h's softmax takes one more logit, sinks[h] as it is
(neither scaled nor capped), that has no value: out = sum_k p_k v_k with
p_k = e^s_k / (e^sinks[h] + sum_j e^s_j), so the keys' weights sum to less than 1.

Blocks wholly before every query's window may be freed while the request runs, their
block-table entries pointing at a placeholder of garbage (NaN), so these never read them:
a masked score does not make 0 * NaN harmless in P @ V. Nor do they read table columns
past a sequence's own blocks. Scores and softmax are float32, rounded once at the end.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Elements of one [rows, heads, keys] float32 score slab of the soft-capped prefill (which
# SDPA cannot run): bounds its memory at 64 MiB whatever the chunk.
_SCORES_BUDGET = 1 << 24
# The fewest query rows a windowed prefill slice takes (one call per slice).
_MIN_ROWS = 128


def softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim, with one more logit per row when `sinks` (broadcast to
    scores[..., :1]) is given, dropped from the result."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    joined = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(joined, dim=-1)[..., :-1]


def soft_cap_(scores: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    """scores = soft_cap * tanh(scores / soft_cap), in place (no-op for None)."""
    if soft_cap is not None:
        scores.div_(soft_cap).tanh_().mul_(soft_cap)
    return scores


def effective_context(query_len: int, seq_len: int, sliding_window: int | None) -> int:
    """Keys a chunk of query_len rows ending at seq_len reads: the union of its windows."""
    if sliding_window is None:
        return seq_len
    return min(seq_len, query_len + sliding_window - 1)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape[:-1], -1, cache.shape[2], cache.shape[3])


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None, soft_cap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence (at position seq_len - 1): [N, H, D] -> [N, H, D]."""
    num_seqs, num_heads, head_dim = query.shape
    if num_seqs == 0:
        return torch.empty_like(query)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    lens = seq_lens.long()
    if int(lens.min()) < 1:
        raise ValueError("seq_lens: a decode row's sequence must hold at least its own token")
    first = (lens - sliding_window).clamp_(min=0) if sliding_window else torch.zeros_like(lens)
    first_block, last_block = first // block_size, (lens - 1) // block_size
    if int(last_block.max()) >= block_tables.shape[1]:
        raise ValueError(f"seq_lens: {int(lens.max())} exceeds what block_tables can address "
                         f"({block_tables.shape[1] * block_size})")
    span = int((last_block - first_block).max()) + 1
    columns = first_block[:, None] + torch.arange(span, device=query.device)
    # A row with fewer blocks than the widest repeats its own last block (masked below)
    # rather than read the table's padding, which may name the placeholder too.
    block_ids = block_tables.long().gather(1, torch.minimum(columns, last_block[:, None]))
    positions = (columns[:, :, None] * block_size
                 + torch.arange(block_size, device=query.device)).view(num_seqs, -1)
    allowed = (positions >= first[:, None]) & (positions < lens[:, None])
    # [N, KVH, keys, D]: each KV head's keys against its group of query heads.
    keys = _gather(key_cache, block_ids).view(num_seqs, -1, num_kv_heads, head_dim)
    values = _gather(value_cache, block_ids).view(num_seqs, -1, num_kv_heads, head_dim)
    queries = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(queries, keys.float().permute(0, 2, 3, 1)).mul_(scale)
    soft_cap_(scores, soft_cap)
    scores.masked_fill_(~allowed[:, None, None, :], float("-inf"))
    head_sinks = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)
    out = torch.matmul(softmax(scores, head_sinks), values.float().transpose(1, 2))
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, seq_len: int, scale: float,
                      sliding_window: int | None = None, soft_cap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's query chunk [Q, H, D], the last Q of its seq_len positions.

    In slices of query rows, each against the keys its rows see (the window's from the
    slice's first row to its last row's position): with a window the work is O(Q x W),
    not O(Q x context) (a fresh 2,048-token prompt with a 512 window did the whole
    context's work before)."""
    query_len, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    first_query = seq_len - query_len
    lowest = max(0, first_query - sliding_window + 1) if sliding_window else 0
    first_block = lowest // block_size
    block_ids = block_table[first_block: -(-seq_len // block_size)].long()
    skip = lowest - first_block * block_size
    keys = _gather(key_cache, block_ids[None])[0].reshape(-1, num_kv_heads, head_dim)
    values = _gather(value_cache, block_ids[None])[0].reshape(-1, num_kv_heads, head_dim)
    keys, values = keys[skip:skip + seq_len - lowest], values[skip:skip + seq_len - lowest]
    # A window's worth of rows a slice (no fewer than _MIN_ROWS): each slice reads at most
    # twice the keys its rows need. The slices that make their own scores (soft cap, sinks:
    # SDPA takes neither) also keep them in budget.
    rows = query_len if sliding_window is None else max(_MIN_ROWS, sliding_window)
    if soft_cap is not None or sinks is not None:
        keys_seen = seq_len if sliding_window is None else rows + sliding_window
        rows = min(rows, max(1, _SCORES_BUDGET // (num_heads * keys_seen)))
    out = torch.empty_like(query)
    for start in range(0, query_len, rows):
        end = min(query_len, start + rows)
        first, last = first_query + start, first_query + end - 1
        key_lo = max(lowest, first - sliding_window + 1) if sliding_window else 0
        query_pos = torch.arange(first, last + 1, device=query.device)[:, None]
        key_pos = torch.arange(key_lo, last + 1, device=query.device)[None, :]
        allowed = key_pos <= query_pos
        if sliding_window:
            allowed &= key_pos > query_pos - sliding_window
        out[start:end] = _attend(query[start:end], keys[key_lo - lowest:last + 1 - lowest],
                                 values[key_lo - lowest:last + 1 - lowest], allowed, scale,
                                 soft_cap, sinks)
    return out


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            allowed: torch.Tensor, scale: float, soft_cap: float | None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [Q, H, D] against keys/values [K, KVH, D] where allowed [Q, K] -> [Q, H, D]."""
    query_len, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    if soft_cap is None and sinks is None:
        # SDPA's fused CPU kernel wants 4-D [batch, heads, len, dim] with every head's K/V.
        k = keys.repeat_interleave(group, dim=1).transpose(0, 1)[None]
        v = values.repeat_interleave(group, dim=1).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], k, v,
                                             attn_mask=allowed, scale=scale)
        return out[0].transpose(0, 1)
    # Per KV head: its group's rows [Q * group, D] against its keys [D, K].
    q = query.float().view(query_len, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
    scores = torch.matmul(q.reshape(num_kv_heads, -1, head_dim), keys.float().permute(1, 2, 0))
    scores = soft_cap_(scores.mul_(scale), soft_cap).view(num_kv_heads, query_len, group, -1)
    scores.masked_fill_(~allowed[:, None, :], float("-inf"))
    head_sinks = None if sinks is None else sinks.view(num_kv_heads, 1, group, 1)
    probs = softmax(scores, head_sinks).view(num_kv_heads, query_len * group, -1)
    out = torch.matmul(probs, values.float().transpose(0, 1))
    out = out.view(num_kv_heads, query_len, group, head_dim).permute(1, 0, 2, 3)
    return out.reshape(query_len, num_heads, head_dim).to(query.dtype)
