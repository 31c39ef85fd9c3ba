"""LoRA updates: an adapter's layouts (prepare_lora) and which kernel runs each segment of
a step's update (lora_add), by device, row count and host."""
from __future__ import annotations

from dataclasses import replace

import torch

from kernels.cpu import features as cpu_features
from kernels.cpu import lora as cpu_lora
from kernels import lora_ops, torch_invariant
from kernels.lora_ops import LoRASegments, LoRAWeights, SegmentWeights


# Rows of one adapter's segment from which torch's matmuls (MKL / oneDNN's GEMM over all
# the rows) beat the native kernel, by the CPU's level (kernels/cpu/features.py; other
# machines: as baseline) and dtype; None: never. bench/bench_lora_dispatch.py, SmolLM2's
# four layers with the loader's block-diagonal fused B, ranks 16 and 64, one thread, on a
# Zen 4 host (2026-12-05, docs/BENCHMARKS.md):
# - AVX-512 builds (16 lanes, 8 rows a pass), float32: native 1.3-2.2x faster at every
#   row count to 2048. bf16 with AVX512_BF16 (the kernel's bf16 pair dot products against
#   oneDNN's AVX512_BF16 GEMM): native 1.03-3.7x at every count to 2048, 1.5-2x for a
#   prefill's segment of 48-row runs.
# - AMX: oneDNN runs torch's bf16 matmuls on the tiles, and beat the previous kernel from
#   64 rows (2026-12-02); the pair kernel has not been measured there, so 64 stays.
# - avx2 builds (the same host capped), float32: native 1.07-1.65x to 16 rows, torch from
#   32-64 (0.83-0.97); bf16: native 14-48x at every count (torch has no bf16 unit).
LORA_TORCH_MIN_ROWS: dict[str, dict[torch.dtype, int | None]] = {
    "baseline": {torch.float32: 64, torch.bfloat16: None},
    "avx2": {torch.float32: 64, torch.bfloat16: None},
    "avx512": {torch.float32: None, torch.bfloat16: None},
    "avx512_bf16": {torch.float32: None, torch.bfloat16: None},
    "amx": {torch.float32: None, torch.bfloat16: 64},
}


def lora_torch_min_rows(dtype: torch.dtype) -> int | None:
    """The segment length from which torch runs an adapter's update on this host."""
    isa = cpu_features.detect().isa
    return LORA_TORCH_MIN_ROWS.get(isa, LORA_TORCH_MIN_ROWS["baseline"]).get(dtype)


def prepare_lora(a: torch.Tensor, b: torch.Tensor) -> LoRAWeights:
    """One adapter's layer update, A [rank, in] and B [out, rank], in the layouts the
    kernels that will run it read: with bf16 pairs where the native kernel runs its bf16
    dot products (kernels/cpu/lora.py)."""
    weights = LoRAWeights.of(a, b)
    if a.dtype == torch.bfloat16 and a.is_cpu and cpu_lora.runs_pairs():
        return replace(weights, pairs=cpu_lora.pairs_of(weights.a, weights.b))
    return weights


def lora_add(x: torch.Tensor, y: torch.Tensor, segments: LoRASegments,
             weights: SegmentWeights, batch_invariant: bool = False) -> None:
    """y[rows of segment g] += (x[rows of g] A_g^T) B_g^T in place: a step's LoRA update
    for one layer, every adapter group at once (kernels/lora_ops.py defines it).
    CUDA: the segmented Triton kernel; CPU: the native one (float32 / bf16, unit column
    strides) for segments shorter than lora_torch_min_rows, torch's shrink and expand for
    the longer ones (a long prefill's) and for what the native kernel does not take.
    `batch_invariant` (CPU): the native kernel for every segment, whose sums run each row
    alone in a fixed order whatever rows share its segment, else torch one row at a time."""
    if batch_invariant and not x.is_cuda:
        if not cpu_lora.lora_add(x, y, segments, weights):
            torch_invariant.lora_add(x, y, segments, weights)
        return
    if x.is_cuda:
        if _triton_lora_fits(x, y, weights):
            from kernels.triton import lora as triton_lora
            triton_lora.lora_add(x, y, segments, weights)
            return
    else:
        short, long = split_lora_segments(x, segments, weights)
        if long is None:
            if cpu_lora.lora_add(x, y, segments, weights):
                return
        else:
            # A None weight is a segment the kernel skips: each side runs its own segments.
            if short is not None and cpu_lora.lora_add(x, y, segments, short):
                weights = long
    lora_ops.lora_add(x, y, segments, weights)


def split_lora_segments(x: torch.Tensor, segments: LoRASegments, weights: SegmentWeights
                        ) -> tuple[SegmentWeights | None, SegmentWeights | None]:
    """(the native kernel's weights, torch's): each segment's weights on one side and None
    on the other, by its row count against lora_torch_min_rows; None for a side without
    segments (long None: all are the native kernel's)."""
    threshold = lora_torch_min_rows(x.dtype)
    if threshold is None or segments.max_rows < threshold:
        return weights, None
    sizes = segments.starts.diff().tolist()
    is_long = [n >= threshold for n in sizes]
    short = [None if big else w for w, big in zip(weights, is_long)]
    long = [w if big else None for w, big in zip(weights, is_long)]
    return (short if any(w is not None for w in short) else None), long


def _triton_lora_fits(x: torch.Tensor, y: torch.Tensor, weights: SegmentWeights) -> bool:
    return (x.dim() == 2 and y.dtype == x.dtype and x.stride(1) == 1 and y.stride(1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(w is None or (w.a.dtype == x.dtype and w.b.dtype == x.dtype
                                  and w.in_kernel_layout())
                    for w in weights))
