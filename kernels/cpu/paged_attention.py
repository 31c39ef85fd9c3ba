"""The float32 paged attention kernel (kernels/cpu/paged_attention_f32.c): a whole step's
decode rows and prefill chunks in one call, K/V read in place through the block table.

Returns None when it does not apply (no library, dtype, layout, a shape it declines);
kernels.dispatch then runs the torch path with the decode kernel for rows.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kernels.cpu import native as cpu_native

_P, _I32, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {"paged_attention_f32": (_I32, [_P] * 7 + [_I32] * 7 + [_F32, _I32])}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_native.bind(_SIGNATURES)


def paged_attention_f32(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Causal attention of each sequence's query rows qsl[i]:qsl[i+1] (the last ones of
    its seq_lens[i] positions) -> [T, H, D]; rows past qsl[-1] come back zero. Same
    contract as torch_ops.paged_attention, float32 CPU tensors only."""
    lib = _library()
    if (lib is None or query.dtype != torch.float32 or key_cache.dtype != torch.float32
            or value_cache.dtype != torch.float32 or not query.is_cpu
            or not (key_cache.is_contiguous() and value_cache.is_contiguous())):
        return None
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    status = lib.paged_attention_f32(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(),
        tables.data_ptr(), starts.data_ptr(), lens.data_ptr(), tables.shape[0], num_tokens,
        num_heads, key_cache.shape[2], head_dim, key_cache.shape[1], tables.shape[1],
        float(scale), torch.get_num_threads())
    if status != 0:
        return None
    total = int(starts[-1]) if starts.numel() else 0
    if total < num_tokens:
        out[total:].zero_()
    return out
