"""oneDNN's prepacked matmul: the weight re-laid once, at load, in the blocked layout its
GEMM reads, and the row-count buckets every call is padded to.

`prepack` returns None where oneDNN cannot do it (other devices and dtypes, bf16 on CPUs
without a native bf16 reorder); kernels.dispatch then runs F.linear on the dense weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import features as cpu_features


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN's blocked weight layout: bf16 matmuls ~1.3-2x faster for decode-sized batches
    on AVX-512; fp32 ones 1.2-2x faster than MKL's sgemm on an AVX2 EPYC (M = 1..256,
    SmolLM2's shapes; the lm_head 2x at M = 1). CPUs that oneDNN cannot reorder bf16 for
    (AVX2 only), other devices and dtypes keep F.linear."""
    if (weight.device.type != "cpu" or not torch.backends.mkldnn.is_available()
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    features = cpu_features.detect()
    if weight.dtype == torch.bfloat16:
        return features.can_prepack_bf16
    return weight.dtype == torch.float32 and features.is_x86


def prepack(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor | None:
    """The blocked copy of a dense [out, in] weight, or None (see can_prepack). The copy
    does not track later edits of `weight`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint) \
        if can_prepack(weight) else None


def padded_rows(rows: int) -> int:
    """The row count the prepacked path computes `rows` rows with: exact below 16, else
    rounded up to one of 8 steps per power of two (at most 12.5% extra rows). oneDNN
    builds and keeps (ideep's and its own primitive caches, 1024 entries each) a JIT'd
    primitive of ~0.5 MB per weight shape and row count; a server's steps see almost
    every token count up to max_num_batched_tokens, which grew the process by ~0.25 MB
    per request served, 1-2 GB in all. Buckets bound that to ~64 row counts per 1024."""
    step = 1 << max(0, rows.bit_length() - 4)
    return -(-rows // step) * step


def bucket_rows(min_rows: int, max_rows: int) -> list[int]:
    """Every row count `padded_rows` computes for min_rows..max_rows rows."""
    return sorted({padded_rows(rows) for rows in range(max(1, min_rows), max_rows + 1)})


def build_primitives(dense: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     min_rows: int, max_rows: int) -> int:
    """Run `linear` once for every row bucket from min_rows to max_rows, so oneDNN builds
    (and caches) those primitives now rather than on the first step of each size; returns
    how many ran. The primitives are keyed by shape, not by weight, so one layer per
    shape warms every layer of it."""
    buckets = bucket_rows(min_rows, max_rows)
    if not buckets:
        return 0
    x = torch.zeros(buckets[-1], dense.shape[1], dtype=dense.dtype)
    for rows in buckets:  # each a bucket already: linear runs it unpadded
        linear(x[:rows], packed, bias)
    return len(buckets)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b with W as `prepack` laid it out, x's rows padded to their bucket."""
    rows = x.shape[0]
    padded = padded_rows(rows) if x.dim() == 2 else rows
    if padded != rows:  # zero rows in, their outputs dropped
        x = F.pad(x, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out if padded == rows else out[:rows]
