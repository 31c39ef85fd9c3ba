"""Argument checks shared by both implementations.

They only look at shapes, dtypes and devices (never tensor contents), so they cost
microseconds and never force a GPU sync on the hot path.
"""
from __future__ import annotations

import numbers

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)
# A window this long or longer is no window (no context is that long); the kernels take
# the window as a 32-bit int, clamped to this.
MAX_WINDOW = 1 << 30


def _same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    # get_device() is an int (-1 on CPU): comparing torch.device objects costs ~10x more,
    # and these checks run for every layer of every step.
    return a.is_cuda == b.is_cuda and a.get_device() == b.get_device()


def _fail(field: str, message: str) -> None:
    raise ValueError(f"{field}: {message}")


def _check_index(name: str, tensor: torch.Tensor, length: int | None) -> None:
    if tensor.dim() != 1:
        _fail(name, f"expected a 1-D tensor, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in _INDEX_DTYPES:
        _fail(name, f"expected int32 or int64, got {tensor.dtype}")
    if length is not None and tensor.shape[0] != length:
        _fail(name, f"expected length {length}, got {tensor.shape[0]}")


def check_kv_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4:
        _fail("key_cache", "expected [num_blocks, block_size, num_kv_heads, head_dim], "
              f"got shape {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        _fail("value_cache", f"shape {tuple(value_cache.shape)} differs from key_cache "
              f"{tuple(key_cache.shape)}")
    if value_cache.dtype != key_cache.dtype:
        _fail("value_cache", f"dtype {value_cache.dtype} differs from key_cache {key_cache.dtype}")
    if not _same_device(value_cache, key_cache):
        _fail("value_cache", "must be on the same device as key_cache")
    # Both implementations address slots as flat rows, which needs the standard layout.
    if not key_cache.is_contiguous():
        _fail("key_cache", "must be contiguous")
    if not value_cache.is_contiguous():
        _fail("value_cache", "must be contiguous")


def check_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    check_kv_caches(key_cache, value_cache)
    if key.dim() != 3:
        _fail("key", f"expected [num_tokens, num_kv_heads, head_dim], got shape {tuple(key.shape)}")
    if value.shape != key.shape:
        _fail("value", f"shape {tuple(value.shape)} differs from key {tuple(key.shape)}")
    if key.shape[1:] != key_cache.shape[2:]:
        _fail("key", f"heads/head_dim {tuple(key.shape[1:])} do not match key_cache "
              f"{tuple(key_cache.shape[2:])}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != key_cache.dtype:
            _fail(name, f"dtype {tensor.dtype} differs from the cache dtype {key_cache.dtype}")
        if not _same_device(tensor, key_cache):
            _fail(name, "must be on the same device as key_cache")
    _check_index("slot_mapping", slot_mapping, key.shape[0])
    if not _same_device(slot_mapping, key_cache):
        _fail("slot_mapping", "must be on the same device as key_cache")


def check_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float, max_query_len: int,
                          max_seq_len: int, sliding_window: int | None = None,
                          soft_cap: float | None = None) -> None:
    check_kv_caches(key_cache, value_cache)
    if query.dim() != 3:
        _fail("query", f"expected [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if query.shape[2] != head_dim:
        _fail("query", f"head_dim {query.shape[2]} differs from key_cache head_dim {head_dim}")
    if query.shape[1] % num_kv_heads != 0:
        _fail("query", f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != key_cache.dtype:
        _fail("query", f"dtype {query.dtype} differs from the cache dtype {key_cache.dtype}")
    if not _same_device(query, key_cache):
        _fail("query", "must be on the same device as key_cache")
    if block_tables.dim() != 2:
        _fail("block_tables", f"expected [num_seqs, max_blocks], got shape {tuple(block_tables.shape)}")
    if block_tables.dtype not in _INDEX_DTYPES:
        _fail("block_tables", f"expected int32 or int64, got {block_tables.dtype}")
    num_seqs = block_tables.shape[0]
    _check_index("query_start_loc", query_start_loc, num_seqs + 1)
    _check_index("seq_lens", seq_lens, num_seqs)
    for name, tensor in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                         ("seq_lens", seq_lens)):
        if not _same_device(tensor, key_cache):
            _fail(name, "must be on the same device as key_cache")
    if not ((type(scale) is float or isinstance(scale, numbers.Real)) and scale > 0):
        _fail("scale", f"expected a positive float, got {scale!r}")
    if not (type(max_query_len) is int or isinstance(max_query_len, numbers.Integral)) or max_query_len < 0:
        _fail("max_query_len", f"expected a non-negative int, got {max_query_len!r}")
    if not (type(max_seq_len) is int or isinstance(max_seq_len, numbers.Integral)) or max_seq_len < max_query_len:
        _fail("max_seq_len", f"expected an int >= max_query_len, got {max_seq_len!r}")
    if max_seq_len > block_tables.shape[1] * key_cache.shape[1]:
        _fail("max_seq_len", f"{max_seq_len} exceeds what block_tables can address "
              f"({block_tables.shape[1]} blocks x {key_cache.shape[1]} tokens)")
    check_window_and_cap(sliding_window, soft_cap)


def check_window_and_cap(sliding_window: int | None, soft_cap: float | None) -> None:
    """None turns each feature off; a window of W keys (the query's own included) is an
    int >= 1, a soft cap a positive finite real (0 would divide by zero in the tanh)."""
    if sliding_window is not None and not (
            isinstance(sliding_window, numbers.Integral) and not isinstance(sliding_window, bool)
            and sliding_window >= 1):
        _fail("sliding_window", f"expected None or an int >= 1, got {sliding_window!r}")
    if soft_cap is not None and not (
            isinstance(soft_cap, numbers.Real) and not isinstance(soft_cap, bool)
            and 0 < soft_cap < float("inf")):
        _fail("soft_cap", f"expected None or a positive finite float, got {soft_cap!r}")
