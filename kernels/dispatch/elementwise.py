"""Row-wise ops: add_rms_norm, gemma_rms_norm, silu_mul, gelu_tanh_mul, rope, argmax_rows (the native CPU kernel where
it takes the case, else torch)."""
from __future__ import annotations

import torch

from kernels.cpu import native as cpu_native
from kernels import torch_invariant, torch_ops


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, batch_invariant: bool = False) -> torch.Tensor:
    """residual += x in place (when x is given); returns rms_norm(residual) * weight.
    The C kernels sum each row alone; `batch_invariant` makes the torch path do so too."""
    if not residual.is_cuda:
        out = cpu_native.add_rms_norm(x, residual, weight, eps)
        if out is not None:
            return out
    if batch_invariant:
        return torch_invariant.add_rms_norm(x, residual, weight, eps)
    return torch_ops.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    if not gate_up.is_cuda:
        out = cpu_native.silu_mul(gate_up)
        if out is not None:
            return out
    return torch_ops.silu_mul(gate_up)


def gemma_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float, batch_invariant: bool = False) -> torch.Tensor:
    """add_rms_norm with Gemma's (1 + weight) scale, applied in float32 before the one
    rounding to the dtype."""
    if not residual.is_cuda:
        out = cpu_native.gemma_rms_norm(x, residual, weight, eps)
        if out is not None:
            return out
    if batch_invariant:
        return torch_invariant.gemma_rms_norm(x, residual, weight, eps)
    return torch_ops.gemma_rms_norm(x, residual, weight, eps)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for gate_up = [gate | up] (Gemma's GeGLU)."""
    if not gate_up.is_cuda:
        out = cpu_native.gelu_tanh_mul(gate_up)
        if out is not None:
            return out
    return torch_ops.gelu_tanh_mul(gate_up)


def rope(qkv: torch.Tensor, num_heads: int, head_dim: int, rot_half: int,
         positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
         cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of the first num_heads heads of each row of a 2-D buffer (rows may
    be longer: the fused qkv layout) -> contiguous [rows, num_heads, head_dim].

    The native kernel gathers from the [max_pos, rot_half] tables by int64 positions;
    the torch path takes the rows already gathered (cos/sin [rows, 1, rot_half]), which
    the model looks up once per forward for all its layers."""
    if not qkv.is_cuda:
        out = cpu_native.rope(qkv, num_heads, head_dim, rot_half, positions, cos_table, sin_table)
        if out is not None:
            return out
    return torch_ops.rope(qkv, num_heads, head_dim, cos, sin)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's first maximum, int64. On CPU the native kernel (bf16, float32):
    torch.argmax ran a decode batch's float32 logits 7x slower, bf16 ones ~35x (it upcasts
    them first)."""
    if not x.is_cuda:
        out = cpu_native.argmax_rows(x)
        if out is not None:
            return out
    return torch_ops.argmax_rows(x)
