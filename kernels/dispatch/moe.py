"""Mixture-of-experts experts: the one door the model layer (engine/models/moe.py) runs them
through, after it has routed. kernels/torch_moe.py defines the op; this picks who runs it:

  CPU  -> kernels/cpu/moe.py's fused_moe_cpu where that module exists and takes the call
          (it returns None to decline: a dtype, layout or activation it lacks), else torch;
  CUDA -> torch (no Triton MoE kernel yet).

The torch definition loops over the experts in Python: right for tests and small models,
not fast. `batch_invariant`: the native kernel is row-invariant as it is (each row's
experts and slots in a fixed order, whatever rows share the call); the torch definition
is not (its matmuls may block and round differently by how many rows an expert got), so
in that mode it runs one row at a time: slow, but a row's bits are its own."""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import torch_moe
from kernels.dispatch.gguf import gguf_linear
from kernels.gguf_weight import GgufWeight
from kernels.torch_mxfp4 import Mxfp4Stack


@dataclass(slots=True)
class ExpertWeights:
    """One MoE layer's experts, stacked: w13 [E, 2I, H] (each expert's gate rows, then its
    up rows), w2 [E, H, I], in the model dtype; biases [E, 2I] / [E, H] or None.
    GGUF form (quantization="gguf"): w13_gguf / w2_gguf hold per expert its [2I, H] and
    [H, I] tables in the file's blocks, and w13 / w2 are None.
    MXFP4 form (gpt-oss checkpoints): w13 / w2 are kernels/torch_mxfp4.Mxfp4Stack, blocks
    and scales laid out as the dense stacks' rows (gate rows then up rows), dequantizing
    to the model dtype; the native kernel reads them as they are, and the torch
    definition indexes them like dense stacks, one expert's dense copy at a time."""
    w13: torch.Tensor | Mxfp4Stack | None
    w2: torch.Tensor | Mxfp4Stack | None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    w13_gguf: tuple[GgufWeight, ...] | None = None
    w2_gguf: tuple[GgufWeight, ...] | None = None


@functools.cache
def native_cpu_kernel() -> Callable | None:
    """kernels/cpu/moe.py's fused_moe_cpu, or None where that module is not there (it is
    optional: the torch definition stands in) or does not import. Looked up once."""
    if importlib.util.find_spec("kernels.cpu.moe") is None:
        return None
    try:
        from kernels.cpu.moe import fused_moe_cpu
    except ImportError:
        return None
    return fused_moe_cpu


def fused_moe(x: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", *, alpha: float = 1.702,
              limit: float = 7.0, batch_invariant: bool = False) -> torch.Tensor:
    """x [T, H]; topk_weights [T, k] float, topk_ids [T, k] integer (the router's result;
    ids outside [0, E) contribute nothing) -> [T, H] in x's dtype: kernels/torch_moe.py's
    fused_moe, by whichever kernel takes it."""
    if experts.w13_gguf is not None:
        return _fused_moe_gguf(x, experts, topk_weights, topk_ids, activation, alpha, limit,
                               batch_invariant)
    if x.device.type == "cpu":
        native = native_cpu_kernel()
        if native is not None:
            out = native(x, experts.w13, experts.w2, topk_weights, topk_ids, activation,
                         w13_bias=experts.w13_bias, w2_bias=experts.w2_bias, alpha=alpha,
                         limit=limit)
            if out is not None:
                return out
    options = dict(w13_bias=experts.w13_bias, w2_bias=experts.w2_bias, alpha=alpha, limit=limit)
    if batch_invariant and x.shape[0] > 1:
        return torch.cat([torch_moe.fused_moe(x[t:t + 1], experts.w13, experts.w2,
                                              topk_weights[t:t + 1], topk_ids[t:t + 1],
                                              activation, **options)
                          for t in range(x.shape[0])])
    return torch_moe.fused_moe(x, experts.w13, experts.w2, topk_weights, topk_ids, activation,
                               **options)


def _fused_moe_gguf(x: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, activation: str, alpha: float, limit: float,
                    batch_invariant: bool) -> torch.Tensor:
    """kernels/torch_moe.py's definition with each routed expert's two matmuls run by
    gguf_linear on the rows sent to it: an expert's tables stay in their blocks (no dense
    copy of a layer's experts), and `batch_invariant` takes gguf_linear's one-row order."""
    def expert_forward(expert: int, rows_x: torch.Tensor) -> torch.Tensor:
        b13 = None if experts.w13_bias is None else experts.w13_bias[expert]
        b2 = None if experts.w2_bias is None else experts.w2_bias[expert]
        h = gguf_linear(rows_x, experts.w13_gguf[expert], b13, batch_invariant)
        return gguf_linear(torch_moe.moe_activation(h, activation, alpha, limit),
                           experts.w2_gguf[expert], b2, batch_invariant)

    return torch_moe.combine_experts(x, experts.w2_gguf[0].out_features,
                                     len(experts.w13_gguf), topk_weights, topk_ids,
                                     expert_forward)
