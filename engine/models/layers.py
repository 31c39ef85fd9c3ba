"""Building blocks shared by the Llama-family decoders. Weights are bare parameters
created uninitialised (the loader fills them), so building a model costs no RNG time."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dispatch
from kernels.dispatch import GgufWeight
from kernels.dispatch import LinearWeight


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b); W is [out, in], the layout HF checkpoints store. The parameters are
    what loading and sharding fill; `prepared` is what the matmul runs on (kernels.dispatch:
    prepacked, native GEMM panels or a GGUF-quantized copy; for the last two the dense
    parameter is then dropped: `unpack` restores it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.bias = empty_param(out_features, dtype=dtype) if bias else None
        # None until prepack / quantize: the parameters then run as they are.
        self.prepared: LinearWeight | None = None

    def prepack(self, batch_invariant: bool = False) -> None:
        if self.prepared is not None and self.prepared.quantized is not None:
            self.prepared.batch_invariant = batch_invariant  # GGUF blocks, from quantize
            return
        self.unpack()
        self.prepared = dispatch.prepare_linear(self.weight, self.bias, batch_invariant)
        if self.prepared.dense is None:  # packed panels, now the only copy of W
            self.weight = None

    def unpack(self) -> None:
        """Give the layer its dense [out, in] parameter back (bit-exact) if packing dropped
        it, for what edits weights after loading (tensor-parallel sharding)."""
        if self.weight is None and self.prepared is not None and self.prepared.panels is not None:
            self.weight = nn.Parameter(self.dense_weight(), requires_grad=False)
            self.prepared = None

    def quantize(self, weight: GgufWeight) -> None:
        if (weight.out_features, weight.in_features) != tuple(self.weight.shape):
            raise ValueError(f"quantization: weight of shape {(weight.out_features, weight.in_features)} "
                             f"for a layer of {tuple(self.weight.shape)}")
        self.prepared, self.weight = dispatch.prepare_linear(weight, self.bias), None

    def dense_weight(self) -> torch.Tensor:
        """[out, in] as loaded, also once packing dropped the parameter (unpacked, bit-exact;
        GGUF layers have no exact dense copy)."""
        return self.weight if self.weight is not None else dispatch.unpack_linear(self.prepared)

    def kernel_weight(self) -> LinearWeight:
        return self.prepared or LinearWeight(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.linear(x, self.prepared or LinearWeight(self.weight, self.bias))


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
        self.batch_invariant = False  # set by LlamaForCausalLM.prepack

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); the residual is updated in place."""
        if residual is None:
            return dispatch.add_rms_norm(None, x, self.weight, self.eps, self.batch_invariant), x
        return (dispatch.add_rms_norm(x, residual, self.weight, self.eps, self.batch_invariant),
                residual)


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
        gate_up = self.gate_up_proj
        if type(gate_up) is Linear:  # not wrapped (LoRA): the matmul may end in silu_mul
            return self.down_proj.forward(dispatch.gate_up_silu(x, gate_up.kernel_weight()))
        return self.down_proj.forward(dispatch.silu_mul(gate_up.forward(x)))


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores w and the scale is (1 + w); HF normalises,
    scales by (1 + w) in float32 and rounds to the model dtype once (Llama's rounds
    before its weight multiply), so this does the same (kernels.torch_ops.gemma_rms_norm;
    on CPU the native kernel, which the fused single-sequence decode also runs). Same
    interface as RMSNorm."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_param(hidden_size, dtype=dtype)
        self.eps = eps
        self.batch_invariant = False  # set by prepack

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); the residual is updated in place."""
        if residual is None:
            return dispatch.gemma_rms_norm(None, x, self.weight, self.eps,
                                           self.batch_invariant), x
        return (dispatch.gemma_rms_norm(x, residual, self.weight, self.eps,
                                        self.batch_invariant), residual)


class GeGLUMLP(SwiGLUMLP):
    """down(gelu_tanh(gate(x)) * up(x)) (Gemma's gelu_pytorch_tanh): SwiGLUMLP's fused
    layers and names, which LoRA and sharding wrap, with another activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Read after sharding too: a rank's gate_up holds its own slice of both halves.
        return self.down_proj.forward(dispatch.gelu_tanh_mul(self.gate_up_proj.forward(x)))
