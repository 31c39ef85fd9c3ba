"""The paged attention kernels for float32 and bf16: a whole step's decode rows and
prefill chunks in one call, K/V read in place through the block table
(kernels/cpu/paged_attention_f32.c), and bf16 prefill chunks on AMX tiles
(kernels/cpu/prefill_attention_amx.c).

Each returns None (or False) when it does not apply (no library, dtype, layout, a shape
it declines); kernels.dispatch then runs the torch path with the decode kernel for rows.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kernels.cpu import native as cpu_native
from kernels.validation import MAX_WINDOW

_P, _I32, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# ... scale, window (0: none), soft cap (0: none), threads
_ARGS = (_I32, [_P] * 7 + [_I32] * 7 + [_F32, _I32, _F32, _I32])
_SIGNATURES = {"paged_attention_f32": _ARGS, "paged_attention_bf16": _ARGS,
               "prefill_attention_amx_built": (_I32, []),
               "prefill_attention_amx": (_I32, [_P] * 8 + [_I32] * 7 + [_F32, _I32, _F32, _I32])}
_KERNELS = {torch.float32: "paged_attention_f32", torch.bfloat16: "paged_attention_bf16"}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_native.bind(_SIGNATURES)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> torch.Tensor | None:
    """Causal attention of each sequence's query rows qsl[i]:qsl[i+1] (the last ones of
    its seq_lens[i] positions) -> [T, H, D]; rows past qsl[-1] come back zero. Same
    contract as torch_ops.paged_attention, for float32 or bf16 CPU tensors (query and
    caches of one dtype; bf16 computes in float32 and rounds the output). With
    `sliding_window` / `soft_cap` as torch_ops.paged_attention."""
    lib = _library()
    name = _KERNELS.get(query.dtype)
    if (lib is None or name is None or key_cache.dtype != query.dtype
            or value_cache.dtype != query.dtype or not query.is_cpu
            or not (key_cache.is_contiguous() and value_cache.is_contiguous())):
        return None
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    status = getattr(lib, name)(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr(), starts.data_ptr(), lens.data_ptr(), tables.shape[0], num_tokens,
        num_heads, key_cache.shape[2], head_dim, key_cache.shape[1], tables.shape[1],
        float(scale), min(sliding_window or 0, MAX_WINDOW), float(soft_cap or 0.0),
        torch.get_num_threads())
    if status != 0:
        return None
    total = int(starts[-1]) if starts.numel() else 0
    if total < num_tokens:
        out[total:].zero_()
    return out


@lru_cache(maxsize=1)
def prefill_amx_built() -> bool:
    """Whether the loaded build carries the AMX prefill kernel (compiled for AMX-BF16 and
    AVX-512 BF16); asked once per attention call on AMX hosts, so cached."""
    lib = _library()
    return lib is not None and bool(lib.prefill_attention_amx_built())


def prefill_attention_amx(query: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, block_tables: torch.Tensor,
                          chunk_starts: torch.Tensor, chunk_lens: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                          sliding_window: int | None = None,
                          soft_cap: float | None = None) -> bool:
    """Causal attention of bf16 prefill chunks on AMX tiles, written into `out` [T, H, D]:
    chunk i is query rows chunk_starts[i] .. + chunk_lens[i], the last chunk_lens[i] of its
    seq_lens[i] positions, over the context that block_tables[i] addresses (rows of `out`
    outside the chunks are left as they are). False where it does not apply (no such
    build, dtypes, layout, head_dim not a multiple of 64, a GQA group over 16 heads, a
    block_size not a multiple of 16, lengths it cannot address); `out` is then untouched."""
    if not (prefill_amx_built() and query.is_cpu
            and query.dtype == key_cache.dtype == value_cache.dtype == out.dtype == torch.bfloat16
            and key_cache.is_contiguous() and value_cache.is_contiguous()
            and out.is_contiguous() and out.shape == query.shape):
        return False
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    starts = chunk_starts.to(torch.int32).contiguous()
    lens = chunk_lens.to(torch.int32).contiguous()
    context = seq_lens.to(torch.int32).contiguous()
    num_tokens, num_heads, head_dim = query.shape
    status = _library().prefill_attention_amx(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr(), starts.data_ptr(), lens.data_ptr(), context.data_ptr(),
        tables.shape[0], num_tokens, num_heads, key_cache.shape[2], head_dim,
        key_cache.shape[1], tables.shape[1], float(scale),
        min(sliding_window or 0, MAX_WINDOW), float(soft_cap or 0.0), torch.get_num_threads())
    return status == 0


def paged_attention_f32(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                        soft_cap: float | None = None) -> torch.Tensor | None:
    """paged_attention for float32 tensors only (None for any other dtype)."""
    if query.dtype != torch.float32:
        return None
    return paged_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                           seq_lens, scale, sliding_window, soft_cap)
