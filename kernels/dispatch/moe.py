"""Mixture-of-experts experts: the one door the model layer (engine/models/moe.py) runs them
through, after it has routed. kernels/torch_moe.py defines the op; this picks who runs it:

  CPU  -> kernels/cpu/moe.py's fused_moe_cpu where that module exists and takes the call
          (it returns None to decline: a dtype, layout or activation it lacks), else torch;
  CUDA -> torch (no Triton MoE kernel yet).

The torch definition loops over the experts in Python: right for tests and small models,
not fast."""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import torch_moe


@dataclass(slots=True)
class ExpertWeights:
    """One MoE layer's experts, stacked: w13 [E, 2I, H] (each expert's gate rows, then its
    up rows), w2 [E, H, I], in the model dtype; biases [E, 2I] / [E, H] or None."""
    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None


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
              limit: float = 7.0) -> torch.Tensor:
    """x [T, H]; topk_weights [T, k] float, topk_ids [T, k] integer (the router's result)
    -> [T, H] in x's dtype: kernels/torch_moe.py's fused_moe, by whichever kernel takes it."""
    if x.device.type == "cpu":
        native = native_cpu_kernel()
        if native is not None:
            out = native(x, experts.w13, experts.w2, topk_weights, topk_ids, activation,
                         w13_bias=experts.w13_bias, w2_bias=experts.w2_bias, alpha=alpha,
                         limit=limit)
            if out is not None:
                return out
    return torch_moe.fused_moe(x, experts.w13, experts.w2, topk_weights, topk_ids, activation,
                               w13_bias=experts.w13_bias, w2_bias=experts.w2_bias, alpha=alpha,
                               limit=limit)
