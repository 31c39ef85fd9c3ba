"""Torch fallbacks of the batch-invariant kernels (kernels.dispatch, batch_invariant mode),
for what the native CPU kernels decline: float16, hosts without a C compiler.

Each handles one row at a time with the shapes a lone row has, so the library sees the
same problem, and picks the same algorithm and summation order, whatever the batch. They
are slow (one library call a row) and exist so the mode's promise holds everywhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import lora_ops, torch_ops


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b, one [1, in] GEMV per row."""
    rows = [F.linear(x[r:r + 1], weight, bias) for r in range(x.shape[0])]
    return torch.cat(rows) if rows else F.linear(x, weight, bias)


def lora_add(x: torch.Tensor, y: torch.Tensor, segments: lora_ops.LoRASegments,
             weights: lora_ops.SegmentWeights) -> None:
    """lora_ops.lora_add one row at a time: each row's shrink and expand are [1, in] and
    [1, rank] products, whatever the segment's size."""
    starts = segments.starts.tolist()
    for g, w in enumerate(weights):
        if w is None:
            continue
        a, b = w.a, w.b
        for row in segments.rows[starts[g]:starts[g + 1]].tolist():
            y[row:row + 1] += (x[row:row + 1] @ a.t()) @ b.t()


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, sliding_window: int | None = None,
                     soft_cap: float | None = None) -> torch.Tensor:
    """torch_ops.decode_attention per row: its context is padded to its own length's
    blocks (its own window's, with sliding_window), never to the longest row of the batch."""
    if query.shape[0] == 0:
        return torch.empty_like(query)
    return torch.cat([
        torch_ops.decode_attention(query[r:r + 1], key_cache, value_cache,
                                   block_tables[r:r + 1], seq_lens[r:r + 1], scale,
                                   sliding_window=sliding_window, soft_cap=soft_cap)
        for r in range(query.shape[0])])


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """torch_ops.add_rms_norm a row at a time (the residual is still updated in place)."""
    if residual.dim() != 2 or residual.shape[0] == 0:
        return torch_ops.add_rms_norm(x, residual, weight, eps)
    return torch.cat([
        torch_ops.add_rms_norm(None if x is None else x[r:r + 1], residual[r:r + 1], weight, eps)
        for r in range(residual.shape[0])])


def gemma_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """torch_ops.gemma_rms_norm a row at a time, with a lone row's shapes."""
    if residual.dim() != 2 or residual.shape[0] == 0:
        return torch_ops.gemma_rms_norm(x, residual, weight, eps)
    return torch.cat([
        torch_ops.gemma_rms_norm(None if x is None else x[r:r + 1], residual[r:r + 1], weight,
                                 eps)
        for r in range(residual.shape[0])])
