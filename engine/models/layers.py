"""Building blocks shared by the Llama-family decoders. Weights are bare parameters
created uninitialised (the loader fills them), so building a model costs no RNG time."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dispatch
from kernels.cpu import features as cpu_features
from kernels.cpu.gguf_weight import GgufWeight


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


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


def prepack_weight(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor | None:
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


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
           packed: torch.Tensor | None, quantized: GgufWeight | None = None) -> torch.Tensor:
    if quantized is not None:
        return dispatch.gguf_linear(x, quantized, bias)
    rows_out = dispatch.dense_linear_rows(x, weight, bias)
    if rows_out is not None:
        return rows_out
    if packed is not None:
        rows = x.shape[0]
        padded = padded_rows(rows) if x.dim() == 2 else rows
        if padded != rows:  # zero rows in, their outputs dropped
            x = F.pad(x, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out if padded == rows else out[:rows]
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """y = x W^T (+ b); W is [out, in], the layout HF checkpoints store, or, once
    `quantize` has run, a GGUF-quantized copy of it (the dense one is dropped)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.bias = empty_param(out_features, dtype=dtype) if bias else None
        self.packed: torch.Tensor | None = None
        self.quantized: GgufWeight | None = None

    def prepack(self) -> None:
        if self.weight is not None:
            self.packed = prepack_weight(self.weight)

    def quantize(self, weight: GgufWeight) -> None:
        if (weight.out_features, weight.in_features) != tuple(self.weight.shape):
            raise ValueError(f"quantization: weight of shape {(weight.out_features, weight.in_features)} "
                             f"for a layer of {tuple(self.weight.shape)}")
        self.quantized, self.packed, self.weight = weight, None, None
        if self.bias is not None:  # the kernel adds a float32 bias
            self.bias = nn.Parameter(self.bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.quantized)


class Embedding(nn.Module):
    """Token id -> row of `weight` [vocab, hidden]; tensor parallelism swaps in a
    vocabulary-sliced subclass (engine/distributed/sharding.py)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(num_embeddings, embedding_dim, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (numerics: kernels.torch_ops.add_rms_norm,
    HF's rounding order)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); the residual is updated in place."""
        if residual is None:
            return dispatch.add_rms_norm(None, x, self.weight, self.eps), x
        return dispatch.add_rms_norm(x, residual, self.weight, self.eps), residual


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # .forward: see engine/models/llama.py LlamaAttention
        return self.down_proj.forward(dispatch.silu_mul(self.gate_up_proj.forward(x)))
