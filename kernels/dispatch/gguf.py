"""GGUF-quantized weights: the layout they are served in and which kernel runs a matmul
or an embedding lookup on their blocks, by row count and host."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import gemm as cpu_gemm
from kernels.cpu import linear as cpu_linear
from kernels import torch_invariant
from kernels.gguf_weight import GgufWeight


def gguf_kernel_available() -> bool:
    """Whether gguf_linear runs natively; its torch path dequantizes W on every call,
    too slow to serve with, so the loader keeps weights dense without it."""
    return cpu_linear.available()


# From this many rows (long prefill chunks) a GGUF matmul dequantizes W to float32 and
# runs the dense GEMM: compute-bound there, oneDNN/MKL's blocking beats the int8 kernel's
# tiles, and writing W out once (~0.5 ns a weight) is paid back over the rows. Below it
# the int8 kernel wins (1.2x oneDNN at 16 rows, 0.9-1.1x at 64; 2-core AVX2 EPYC).
GGUF_DENSE_MIN_ROWS = 256
# Where the native float32 GEMM is preferred (AVX2), float32 batches from this many rows
# widen W a few rows at a time inside it instead: 1.1-1.2x the int8 kernel at 16 rows,
# 1.3x at 64, 1.5-1.7x at 128, 0.55-0.7x at 8 (SmolLM2's layers, Q4_1 and Q8_0, 1 thread's
# CPU time on a 2-core AVX2 EPYC).
GGUF_PANEL_MIN_ROWS = 16
# Where AMX runs (kernels/cpu/linear_gguf_amx.c), bf16 batches from this many rows widen W
# to bf16 a 32-row block at a time and multiply on tiles instead of any path below: at 8
# rows 1.8-2.5x the int8 kernel (it breaks even at 4-6), 9-11x at 64, 12-17x at 256, and
# 0.6-1.4x a dense bf16 oneDNN matmul throughout; one row 0.3-0.5x (widening W costs the
# same for any row count). SmolLM2-135M's layers, Q4_1 and Q8_0, 1 thread (2 threads
# alike), 2-core Sapphire Rapids (amx), shared host.
GGUF_AMX_MIN_ROWS = 8


def prepare_gguf(weight: GgufWeight) -> GgufWeight:
    """The layout a GGUF weight is served in: VNNI panels where that kernel is built and
    AMX's is not in use (it reads rows; which is faster there was not measured), else the
    file's rows. On a 2-core Zen 4 (AVX-512 VNNI + BF16), SmolLM2's layers at bf16 x, Q4_1
    and Q8_0, the panels ran 1.4-4.7x the row kernel, and 2.3-3.0x oneDNN's dense bf16
    GEMM on the same weights at one row, 1.23-1.55x at 16-256 rows (1.03-1.29x at 512-2048:
    no dense route beside them); Llama-3.2-1B's alike (bench.bench_gguf_kernels). The
    panels replace the rows: the embedding lookup and the torch paths read them too."""
    if (weight.layout == "rows" and cpu_linear.gguf_vnni_built()
            and not cpu_linear.gguf_amx_available()):
        return weight.to_panels()
    return weight


def gguf_linear(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None,
                batch_invariant: bool = False) -> torch.Tensor:
    """x W^T + b for W in GGUF blocks ([tokens, in] -> [tokens, out], x's dtype). The
    native kernel quantizes x to int8 per 32-block (as llama.cpp does); the torch path
    dequantizes W, which is exact but slow (hosts without a C compiler). Panels (VNNI,
    prepare_gguf) run their kernel at every row count; rows go by the row count below.
    `batch_invariant`: every row in the kernel's one-row order, for any row count."""
    if batch_invariant:
        out = cpu_linear.linear_gguf(x, weight, bias, single_row_order=True)
        if out is not None:
            return out
        return torch_invariant.linear(x, weight.dequantize().to(x.dtype), bias)
    if weight.layout == "panels":  # prepare_gguf chose the VNNI kernel for every row count
        out = cpu_linear.linear_gguf(x, weight, bias)
        if out is not None:
            return out
        return F.linear(x, weight.dequantize().to(x.dtype), bias)
    if (x.dim() == 2 and x.shape[0] >= GGUF_AMX_MIN_ROWS and x.dtype == torch.bfloat16
            and cpu_linear.gguf_amx_available()):
        out = cpu_linear.linear_gguf_amx(x, weight, bias)
        if out is not None:
            return out
    if (x.dim() == 2 and x.shape[0] >= GGUF_PANEL_MIN_ROWS and x.dtype == torch.float32
            and cpu_gemm.preferred()):
        out = cpu_gemm.gemm_gguf(x, weight, bias)
        if out is not None:
            return out
    if x.dim() == 2 and x.shape[0] >= GGUF_DENSE_MIN_ROWS:
        dense = cpu_linear.dequantize_rows(weight, None)
        if dense is not None:
            return F.linear(x, dense.to(x.dtype), bias if bias is None else bias.to(x.dtype))
    out = cpu_linear.linear_gguf(x, weight, bias)
    if out is not None:
        return out
    return F.linear(x, weight.dequantize().to(x.dtype), bias)


def gguf_embedding(token_ids: torch.Tensor, weight: GgufWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a quantized embedding table, dequantized -> [tokens, hidden] in `dtype`."""
    out = cpu_linear.dequantize_rows(weight, token_ids)
    if out is None:
        out = weight.dequantize(token_ids.long())
    return out.to(dtype)
