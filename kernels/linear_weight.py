"""A Linear layer's weight as the matmul kernels take it (kernels.dispatch.linear).

The model holds one per layer and never looks inside: dispatch.prepare_linear builds it
once loading is done, and the kind of weight it holds decides the kernel family.
"""
from __future__ import annotations

import torch

from kernels.gguf_weight import GgufWeight


class LinearWeight:
    """dense: [out, in] (float32 or bf16, any device), None once GGUF blocks or panels
    replace it; panels: the weight packed for a native GEMM (kernels/cpu/gemm.py: float32
    where that GEMM is the fastest and under batch_invariant, bf16 on AVX-512 BF16 and AMX
    hosts), then the only copy (every row count runs on it, and out_features says how many
    of the padded columns are real); packed: oneDNN's blocked
    copy of dense, where that is (CPU);
    quantized: the GGUF blocks; bias: [out] or None (float32 beside GGUF blocks);
    batch_invariant: every row runs the one kernel whose sums over `in` go in a fixed order,
    whatever the row count (never oneDNN-packed then; float32 ones hold panels, which every
    row count, one row included, runs through)."""

    # Slots: dispatch.linear reads these ~120 times a decode step.
    __slots__ = ("dense", "packed", "quantized", "bias", "panels", "out_features",
                 "batch_invariant")

    def __init__(self, dense: torch.Tensor | None, bias: torch.Tensor | None,
                 packed: torch.Tensor | None = None, quantized: GgufWeight | None = None,
                 panels: torch.Tensor | None = None, batch_invariant: bool = False,
                 out_features: int | None = None) -> None:
        self.dense, self.bias, self.packed, self.quantized = dense, bias, packed, quantized
        self.panels, self.batch_invariant = panels, batch_invariant
        self.out_features = (out_features if out_features is not None
                             else quantized.out_features if quantized is not None
                             else dense.shape[0])

    @property
    def kind(self) -> str:
        """"gguf", "panels" (the native GEMM), "onednn" (prepacked), "dense", "invariant"
        (dense, row kernel for any row count) or "invariant-panels" (the native GEMM for any
        row count): the family dispatch.linear runs; within the non-invariant ones the row
        count still picks (native rows for few, a dense GEMM for long chunks)."""
        if self.batch_invariant and self.quantized is None:
            return "invariant" if self.panels is None else "invariant-panels"
        if self.quantized is not None:
            return "gguf"
        if self.panels is not None:
            return "panels"
        return "dense" if self.packed is None else "onednn"

    @property
    def in_features(self) -> int:
        if self.quantized is not None:
            return self.quantized.in_features
        if self.panels is not None:  # float32 [panels, in, 16]; bf16 [panels, in / 2, 16, 2]
            return self.panels.shape[1] * (2 if self.panels.dim() == 4 else 1)
        return self.dense.shape[1]

    @property
    def table(self) -> torch.Tensor | GgufWeight:
        """The weight the native kernels read: the GGUF blocks, else the dense tensor."""
        return self.dense if self.quantized is None else self.quantized
