"""The fused mixture-of-experts op on CPU (kernels/cpu/moe.c), loaded with the other C
kernels (cpu_native). kernels/torch_moe.py defines what it computes; kernels.dispatch
asks this first and runs the torch op when it declines (returns None).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kernels.cpu import native as cpu_native
from kernels.torch_moe import ACTIVATIONS

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "fused_moe_rows": (_I32, [_P, _I32, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I32, _I64,
                              _P, _P, _I32, _F32, _F32, _P, _I32]),
}
_DTYPES = (torch.float32, torch.bfloat16)


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_native.bind(_SIGNATURES)


def _fits(t: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return t is None or (t.dtype == dtype and t.is_cpu and t.is_contiguous()
                         and tuple(t.shape) == shape)


def fused_moe_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
                  *, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor | None:
    """torch_moe.fused_moe's arguments and result, or None where this kernel does not apply:
    no library, x not float32/bf16 on CPU, weights or biases not contiguous in x's dtype
    (a float32 bias beside bf16 weights included: torch's op cannot run that either), or
    shapes that do not match."""
    lib = _library()
    if (lib is None or activation not in ACTIVATIONS or x.dim() != 2 or x.dtype not in _DTYPES
            or not x.is_cpu or w13.dim() != 3 or w2.dim() != 3):
        return None
    tokens, hidden = x.shape
    experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if (not _fits(w13, x.dtype, (experts, 2 * inter, hidden))
            or not _fits(w2, x.dtype, (experts, hidden, inter))
            or not _fits(w13_bias, x.dtype, (experts, 2 * inter))
            or not _fits(w2_bias, x.dtype, (experts, hidden))
            or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens
            or tuple(topk_weights.shape) != tuple(topk_ids.shape)
            or topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex
            or not (topk_ids.is_cpu and topk_weights.is_cpu)):
        return None
    ids = topk_ids if topk_ids.dtype in (torch.int32, torch.int64) else topk_ids.long()
    ids = ids.contiguous()
    weights = topk_weights.float().contiguous()  # any float dtype, used in float32 as torch_moe
    x = x.contiguous()
    out = torch.empty(tokens, hidden, dtype=x.dtype)
    status = lib.fused_moe_rows(
        x.data_ptr(), int(x.dtype == torch.bfloat16), tokens, hidden, w13.data_ptr(),
        w2.data_ptr(), experts, inter, weights.data_ptr(), ids.data_ptr(),
        int(ids.dtype == torch.int64), ids.shape[1],
        None if w13_bias is None else w13_bias.data_ptr(),
        None if w2_bias is None else w2_bias.data_ptr(),
        ACTIVATIONS.index(activation), float(alpha), float(limit), out.data_ptr(),
        torch.get_num_threads())
    return out if status == 0 else None
