"""The segmented LoRA update as one Triton kernel (the punica / SGMV idea): a program
takes a block of one segment's rows, gathers them from x, shrinks them by the segment's
A into a [rows, rank] tile held in registers, and expands that tile by B into y's rows,
block by block of output features. One launch covers every adapter of the step.

The launch gets each segment's A and B as element offsets into one buffer per side:
the storage they share when they were allocated together, else (today's loader) one
concatenated copy per call. Offsets rather than a table of raw addresses, because the
Triton interpreter copies tensor arguments, so addresses of tensors not passed would
read the wrong memory there. Ranks may differ per segment (the tile is padded to the
largest, masked per segment)."""
from __future__ import annotations

from dataclasses import dataclass

import os

import torch
import triton
import triton.language as tl

from kernels.lora_ops import LoRASegments, SegmentWeights
from kernels.triton.common import dot


@dataclass(frozen=True, slots=True)
class LoRATiles:
    """Tile sizes (powers of two >= 16, tl.dot's minimum); tests shrink them."""
    block_m: int = 16
    block_k: int = 64
    block_n: int = 64
    num_warps: int = 4


@triton.jit
def sgmv_kernel(x_ptr, y_ptr, rows_ptr, starts_ptr, a_buf, a_offsets, b_buf, b_offsets,
                ranks_ptr,
                in_features, out_features, x_stride, y_stride,
                RANK_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr):
    seg = tl.program_id(0)
    block = tl.program_id(1)
    seg_start = tl.load(starts_ptr + seg)
    seg_end = tl.load(starts_ptr + seg + 1)
    rank = tl.load(ranks_ptr + seg)
    first = seg_start + block * BLOCK_M
    if (first < seg_end) & (rank > 0):
        offs_m = first + tl.arange(0, BLOCK_M)
        row_mask = offs_m < seg_end
        rows = tl.load(rows_ptr + offs_m, mask=row_mask, other=0)
        a_ptr = a_buf + tl.load(a_offsets + seg)
        b_ptr = b_buf + tl.load(b_offsets + seg)
        offs_r = tl.arange(0, RANK_PAD)
        rank_mask = offs_r < rank
        shrunk = tl.zeros((BLOCK_M, RANK_PAD), dtype=tl.float32)
        for k in range(0, in_features, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            k_mask = offs_k < in_features
            xs = tl.load(x_ptr + rows[:, None] * x_stride + offs_k[None, :],
                         mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            # A^T is [in, rank] row-major: a [BLOCK_K, RANK_PAD] tile.
            at = tl.load(a_ptr + offs_k[:, None] * rank + offs_r[None, :],
                         mask=rank_mask[None, :] & k_mask[:, None], other=0.0)
            shrunk += dot(xs, at, FP32_DOT)
        # As the torch path's two matmuls: the shrink result in the activations' dtype.
        shrunk_in = shrunk.to(x_ptr.dtype.element_ty)
        for n in range(0, out_features, BLOCK_N):
            offs_n = n + tl.arange(0, BLOCK_N)
            n_mask = offs_n < out_features
            # B is column-major (B^T [rank, out] row-major): a [RANK_PAD, BLOCK_N] tile.
            bt = tl.load(b_ptr + offs_r[:, None] * out_features + offs_n[None, :],
                         mask=rank_mask[:, None] & n_mask[None, :], other=0.0)
            update = dot(shrunk_in, bt, FP32_DOT).to(x_ptr.dtype.element_ty)
            y_ptrs = y_ptr + rows[:, None] * y_stride + offs_n[None, :]
            mask = row_mask[:, None] & n_mask[None, :]
            y = tl.load(y_ptrs, mask=mask, other=0.0)
            # The sum in float32 of the two rounded terms, rounded once: what torch's
            # bf16 add gives (and the interpreter has no bf16 arithmetic).
            total = y.to(tl.float32) + update.to(tl.float32)
            tl.store(y_ptrs, total.to(x_ptr.dtype.element_ty), mask=mask)


def lora_add(x: torch.Tensor, y: torch.Tensor, segments: LoRASegments,
             weights: SegmentWeights, tiles: LoRATiles = LoRATiles()) -> None:
    """y[rows of g] += (x[rows of g] A_g^T) B_g^T in place, for 2-D x and y with unit
    column stride, A and B column-major in x's dtype (kernels.dispatch checks)."""
    n = segments.num_segments
    if n == 0 or segments.max_rows == 0:
        return
    device = x.device
    present = [w for w in weights if w is not None]
    if not present:
        return
    a_buf, a_offsets = _one_buffer([w.a.t() for w in present])
    b_buf, b_offsets = _one_buffer([w.b.t() for w in present])
    a_off, b_off, ranks, i = [0] * n, [0] * n, [0] * n, 0
    for g, w in enumerate(weights):
        if w is not None:
            a_off[g], b_off[g], ranks[g] = a_offsets[i], b_offsets[i], w.a.shape[0]
            i += 1
    a_off_t = torch.tensor(a_off, dtype=torch.int64, device=device)
    b_off_t = torch.tensor(b_off, dtype=torch.int64, device=device)
    rank_t = torch.tensor(ranks, dtype=torch.int32, device=device)
    starts = segments.starts.to(device)
    rows = segments.rows.to(device)
    rank_pad = max(16, triton.next_power_of_2(max(ranks)))
    grid = (n, triton.cdiv(segments.max_rows, tiles.block_m))
    sgmv_kernel[grid](x, y, rows, starts, a_buf, a_off_t, b_buf, b_off_t, rank_t, x.shape[1],
                      y.shape[1],
                      x.stride(0), y.stride(0), RANK_PAD=rank_pad, BLOCK_M=tiles.block_m,
                      BLOCK_K=tiles.block_k, BLOCK_N=tiles.block_n,
                      # float32 as torch computes it (not TF32); the interpreter's bf16
                      # tl.dot is broken (kernels/triton/common.py).
                      FP32_DOT=_interpreted() or x.dtype == torch.float32,
                      num_warps=tiles.num_warps)


def _one_buffer(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """A 1-D tensor holding every one of `tensors` (contiguous) and each one's element
    offset in it: their shared storage, or a concatenated copy."""
    storage = tensors[0].untyped_storage()
    if all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in tensors):
        whole = torch.empty(0, dtype=tensors[0].dtype, device=tensors[0].device)
        whole.set_(storage)
        return whole, [t.storage_offset() for t in tensors]
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += t.numel()
    return torch.cat([t.reshape(-1) for t in tensors]), offsets


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
