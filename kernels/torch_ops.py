"""Torch implementations of every kernel kernels.dispatch offers; they define the semantics.

The native CPU kernels (cpu_native) and the Triton kernels are tested against these.
They run whenever no faster kernel handles a case: the paged ops for CPU dtypes and
layouts the C kernels decline, the element-wise ops (add_rms_norm, silu_mul, rope,
argmax_rows) where the native library is absent or declines the dtype, and on CUDA,
which has no Triton kernel for them. Paged layout and semantics: docs/CONTRACTS.md.

Decode rows (one query token per sequence) are handled for the whole batch at once;
each prefill chunk (query length > 1) goes through scaled_dot_product_attention with
its own causal mask, since its keys also include previously cached tokens. Attention
with a sliding window or a logit soft cap is kernels/torch_windowed.py's.

Over 300 lines: the reference semantics of every dispatch op in one place, which the
native and Triton kernels are each tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import torch_windowed

# With a fast decode kernel, prefill chunks whose query_len * seq_len is at most this go
# through it as decode rows (row j of a chunk ending at seq_len attends to the first
# seq_len - query_len + j + 1 positions). Measured with the C kernel against SDPA on
# fresh bf16 prompts, SmolLM2 shapes: 5.3x faster at 16 tokens, 3x at 64, 1.2x at 512,
# slower from ~700 on, where SDPA's fused kernel wins.
ROWS_MAX_WORK = 512 * 512

# Up to this many KV heads the decode path multiplies against a block-diagonal query
# matrix: one large contiguous GEMM per sequence beats KVH tiny strided ones on CPU
# even though it does KVH times the (cheap) arithmetic. Beyond it the wasted FLOPs win.
BLOCK_DIAGONAL_MAX_KV_HEADS = 4


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's K and V into its slot; slot -1 (padding) is skipped."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    flat_keys = key_cache.view(-1, num_kv_heads, head_dim)
    flat_values = value_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.long()
    if slots.numel() and int(slots.min()) < 0:
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    flat_keys.index_copy_(0, slots, key)
    flat_values.index_copy_(0, slots, value)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int, decode=None, rows_only: bool = False,
                    rows_max_work: int = ROWS_MAX_WORK, prefill=None, *,
                    sliding_window: int | None = None,
                    soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its paged context.

    Like the Triton path, this trusts the host-side max_query_len: when it is 1 and
    there is one query row per sequence, the batch is pure decode and skips all
    per-sequence bookkeeping. max_seq_len is not needed on CPU. `decode`: a faster
    implementation of decode_attention (same signature) to use for the decode rows and,
    as rows with their own context lengths, for short prefill chunks (ROWS_MAX_WORK).
    `rows_only`: every query token goes through `decode` as a row (batch-invariant mode:
    a token's attention then depends on its position alone, not on its chunk).
    `rows_max_work`: the short-chunk limit for `decode`, where SDPA is faster than usual.
    `prefill`: a kernel for every other chunk at once, (query, key_cache, value_cache,
    block_tables, chunk_starts, chunk_lens, seq_lens, scale, out, sliding_window=,
    soft_cap=) -> whether it wrote them into `out`; where it declines, each chunk runs
    SDPA (prefill_attention). `decode` takes sliding_window= and soft_cap= too.
    `sliding_window` (W: a query at position p sees keys p - W + 1 .. p) and `soft_cap`
    (logits s -> soft_cap * tanh(s / soft_cap) after scaling): None is plain causal
    attention (kernels/torch_windowed.py).
    """
    options = attention_options(sliding_window, soft_cap)
    fast_decode = decode
    decode = decode or decode_attention
    num_tokens, num_seqs = query.shape[0], seq_lens.shape[0]
    if max_query_len == 1 and num_tokens == num_seqs and int(query_start_loc[-1]) == num_tokens:
        return decode(query, key_cache, value_cache, block_tables, seq_lens, scale, **options)

    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    _check_lengths(query_lens, seq_lens)
    out = torch.empty_like(query)
    total_tokens = int(query_start_loc[-1])
    if total_tokens < num_tokens:
        out[total_tokens:].zero_()
    as_rows = query_lens == 1
    if rows_only:
        as_rows = torch.ones_like(as_rows)
    elif fast_decode is not None:
        context = seq_lens.long()
        if sliding_window is not None:  # the work is over the chunk's windows alone
            context = torch.minimum(context, query_lens.long() + sliding_window - 1)
        as_rows |= query_lens.long() * context <= rows_max_work
    if bool(as_rows.any()):
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=query.device),
                                               query_lens.long(), output_size=total_tokens)
        rows = as_rows[seq_of_token].nonzero().squeeze(1)
        row_seqs = seq_of_token.index_select(0, rows)
        # A chunk's last row sees the whole seq_len, each earlier row one position less.
        row_lens = seq_lens.index_select(0, row_seqs) - (
            query_start_loc.index_select(0, row_seqs + 1) - 1 - rows)
        decoded = decode(query.index_select(0, rows), key_cache, value_cache,
                         block_tables.index_select(0, row_seqs), row_lens.to(seq_lens.dtype), scale,
                         **options)
        out.index_copy_(0, rows, decoded)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    capacity = block_tables.shape[1] * key_cache.shape[1]
    by_rows = as_rows.tolist()
    chunks = [seq for seq, (start, end) in enumerate(zip(starts[:-1], starts[1:]))
              if end - start > 1 and not by_rows[seq]]
    for seq in chunks:
        if lengths[seq] > capacity:
            raise ValueError(f"seq_lens: {lengths[seq]} exceeds what block_tables can "
                             f"address ({capacity})")
    if chunks and prefill is not None:
        picked = torch.tensor(chunks)
        if prefill(query, key_cache, value_cache, block_tables.index_select(0, picked),
                   query_start_loc.index_select(0, picked), query_lens.index_select(0, picked),
                   seq_lens.index_select(0, picked), scale, out, **options):
            return out
    for seq in chunks:
        start, end = starts[seq], starts[seq + 1]
        out[start:end] = prefill_attention(query[start:end], key_cache, value_cache,
                                           block_tables[seq], lengths[seq], scale, **options)
    return out


def attention_options(sliding_window: int | None, soft_cap: float | None) -> dict:
    """The keyword arguments that pass a window / soft cap on to a kernel: none when both
    are off, so today's callables (and their stand-ins in tests) are called as today."""
    if sliding_window is None and soft_cap is None:
        return {}
    return dict(sliding_window=sliding_window, soft_cap=soft_cap)


def _check_lengths(query_lens: torch.Tensor, seq_lens: torch.Tensor) -> None:
    if bool((query_lens < 0).any()):
        raise ValueError("query_start_loc: must be non-decreasing")
    if bool((seq_lens < query_lens).any()):
        raise ValueError("seq_lens: each sequence's length must include its query tokens")


def gather_context(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Rows of `cache` for the given blocks, [len(block_ids) * block_size, KVH * D].

    index_select on whole flattened blocks is several times faster on CPU than
    advanced indexing of the 4-D cache.
    """
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
    return rows.view(-1, cache.shape[2] * cache.shape[3])


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, sliding_window: int | None = None,
                     soft_cap: float | None = None) -> torch.Tensor:
    """One query token per sequence: query [N, H, D] -> [N, H, D]."""
    if sliding_window is not None or soft_cap is not None:
        return torch_windowed.decode_attention(query, key_cache, value_cache, block_tables,
                                               seq_lens, scale, sliding_window, soft_cap)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    shortest, longest = (int(x) for x in torch.aminmax(seq_lens))
    if shortest < 1:
        raise ValueError("seq_lens: a decode row's sequence must hold at least its own token")
    num_blocks = -(-longest // block_size)
    if num_blocks > block_tables.shape[1]:
        raise ValueError(f"seq_lens: {longest} exceeds what block_tables can address "
                         f"({block_tables.shape[1] * block_size})")
    context = num_blocks * block_size
    block_ids = block_tables[:, :num_blocks]
    keys = gather_context(key_cache, block_ids).view(num_seqs, context, num_kv_heads * head_dim)
    values = gather_context(value_cache, block_ids).view(num_seqs, context, num_kv_heads * head_dim)
    padding = None
    if shortest < context:
        padding = torch.arange(context, device=query.device) >= seq_lens[:, None].long()

    if num_kv_heads > BLOCK_DIAGONAL_MAX_KV_HEADS:
        out = F.scaled_dot_product_attention(
            query.view(num_seqs, num_kv_heads, group, head_dim),
            keys.view(num_seqs, context, num_kv_heads, head_dim).transpose(1, 2),
            values.view(num_seqs, context, num_kv_heads, head_dim).transpose(1, 2),
            attn_mask=None if padding is None else ~padding.view(num_seqs, 1, 1, context),
            scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)

    # The scale goes on the small query side rather than on the [N, H, context] scores.
    if num_kv_heads == 1:
        queries = query * scale
    else:
        # queries[n, (kv, g), (kv', d)] = scale * query[n, kv * group + g, d] if kv == kv' else 0
        queries = query.new_zeros(num_seqs, num_kv_heads, group, num_kv_heads, head_dim)
        queries.diagonal(dim1=1, dim2=3).copy_(
            query.view(num_seqs, num_kv_heads, group, head_dim).permute(0, 2, 3, 1))
        queries = queries.view(num_seqs, num_heads, num_kv_heads * head_dim).mul_(scale)
    scores = torch.bmm(queries, keys.transpose(1, 2))
    if padding is not None:
        scores.masked_fill_(padding[:, None, :], float("-inf"))
    # softmax of bf16/fp16 input computes in float32 internally and rounds once at the end.
    out = torch.bmm(torch.softmax(scores, dim=-1), values)
    if num_kv_heads == 1:
        return out
    out = out.view(num_seqs, num_kv_heads, group, num_kv_heads, head_dim)
    return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(num_seqs, num_heads, head_dim)


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, seq_len: int, scale: float,
                      sliding_window: int | None = None,
                      soft_cap: float | None = None) -> torch.Tensor:
    """One sequence's query chunk [Q, H, D], the last Q of its seq_len positions."""
    if sliding_window is not None or soft_cap is not None:
        return torch_windowed.prefill_attention(query, key_cache, value_cache, block_table,
                                                seq_len, scale, sliding_window, soft_cap)
    query_len, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_ids = block_table[: -(-seq_len // block_size)]
    keys = gather_context(key_cache, block_ids)[:seq_len].view(seq_len, num_kv_heads, 1, head_dim)
    values = gather_context(value_cache, block_ids)[:seq_len].view(seq_len, num_kv_heads, 1, head_dim)
    # Expanding K/V to every query head costs a copy of the context, small next to the
    # Q x context work, and keeps SDPA on its fused CPU kernel.
    # SDPA's fused CPU kernel only takes 4-D [batch, heads, len, dim]; 3-D falls back to math.
    keys = keys.expand(-1, -1, group, -1).reshape(1, seq_len, num_heads, head_dim).transpose(1, 2)
    values = values.expand(-1, -1, group, -1).reshape(1, seq_len, num_heads, head_dim).transpose(1, 2)
    queries = query.unsqueeze(0).transpose(1, 2)
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
    else:
        # Query j sits at position seq_len - query_len + j: causal aligned bottom-right.
        positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
        allowed = torch.arange(seq_len, device=query.device)[None, :] <= positions[:, None]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed, scale=scale)
    return out[0].transpose(0, 1)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += x in place (when x is given); returns rms_norm(residual) * weight.

    Normalises in fp32 and rounds to the model dtype before the weight multiply, the
    order HF uses, so bf16 runs track HF's rounding."""
    if x is not None:
        residual.add_(x)
    return F.rms_norm(residual.float(), weight.shape, None, eps).to(residual.dtype) * weight


def gemma_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """Gemma's: residual += x in place (when x is given); returns norm(residual) * (1 +
    weight), scaled in float32 and rounded to the model dtype once, in HF's op sequence (so
    float32 results are HF's to the bit)."""
    if x is not None:
        residual.add_(x)
    xf = residual.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(residual.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    half = gate_up.shape[-1] // 2
    act = F.silu(gate_up[..., :half])
    return act.mul_(gate_up[..., half:])


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for gate_up = [gate | up] along the last dim."""
    half = gate_up.shape[-1] // 2
    act = F.gelu(gate_up[..., :half], approximate="tanh")
    return act.mul_(gate_up[..., half:])


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style (rotate-half) RoPE of x [T, heads, head_dim] (may be a strided view)
    with per-row cos/sin [T, 1, rot_dim/2]; dims past rot_dim pass through (partial
    rotary). Returns a new contiguous tensor."""
    half = cos.shape[-1]
    rot_dim = 2 * half
    x1, x2 = x[..., :half], x[..., half:rot_dim]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if rot_dim == x.shape[-1]:
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., rot_dim:]), dim=-1)


def rope(qkv: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor,
         sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first num_heads heads of each row of a 2-D buffer (rows may be longer:
    the fused qkv layout) -> contiguous [rows, num_heads, head_dim]."""
    rows = qkv.shape[0]
    return rotate_half(qkv[:, :num_heads * head_dim].view(rows, num_heads, head_dim), cos, sin)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's first maximum, int64."""
    return x.argmax(dim=-1)


def quantize_activations_q8(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the GGUF kernel sees it: per block of 32, int8 codes round(x / s) with
    s = max|x| / 127, times s (float32 [rows, k])."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    codes = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1.0)), 0.0)
    return (codes * scale).reshape(x.shape[0], -1)


def gguf_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """What kernels/cpu/linear_quant.c computes for a GgufWeight (kernels/gguf_weight.py):
    the dequantized weights against x quantized per 32-block (llama.cpp's Q8_0 / Q8_1
    activations, with float32 scales)."""
    out = quantize_activations_q8(x) @ weight.dequantize().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
