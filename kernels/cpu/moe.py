"""The fused mixture-of-experts op on CPU (kernels/cpu/moe.c; moe_mxfp4.c for experts
held as MXFP4, kernels/torch_mxfp4.Mxfp4Stack), loaded with the other C kernels
(cpu_native). kernels/torch_moe.py defines what it computes; kernels.dispatch asks this
first and runs the torch op when it declines (returns None).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kernels.cpu import native as cpu_native
from kernels.torch_moe import ACTIVATIONS
from kernels.torch_mxfp4 import BLOCK, Mxfp4Stack

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "fused_moe_rows": (_I32, [_P, _I32, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I32, _I64,
                              _P, _P, _I32, _F32, _F32, _P, _I32]),
    "fused_moe_mxfp4_rows": (_I32, [_P, _I32, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _P, _P,
                                    _I32, _I64, _P, _P, _I32, _F32, _F32, _P, _I32]),
}
_DTYPES = (torch.float32, torch.bfloat16)


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_native.bind(_SIGNATURES)


def _fits(t: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return t is None or (t.dtype == dtype and t.is_cpu and t.is_contiguous()
                         and tuple(t.shape) == shape)


def _fits_mxfp4(stack: Mxfp4Stack, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    experts, rows, cols = shape
    return (stack.dtype == dtype and cols % BLOCK == 0
            and _fits(stack.blocks, torch.uint8, (experts, rows, cols // BLOCK, BLOCK // 2))
            and _fits(stack.scales, torch.uint8, (experts, rows, cols // BLOCK)))


def fused_moe_cpu(x: torch.Tensor, w13: torch.Tensor | Mxfp4Stack, w2: torch.Tensor | Mxfp4Stack,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu",
                  *, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor | None:
    """torch_moe.fused_moe's arguments and result, or None where this kernel does not apply:
    no library, x not float32/bf16 on CPU, weights or biases not contiguous in x's dtype
    (a float32 bias beside bf16 weights included: torch's op cannot run that either), or
    shapes that do not match. w13 and w2 both dense, or both Mxfp4Stack (dequantizing to
    x's dtype, blocks and scales contiguous on the CPU)."""
    lib = _library()
    mxfp4 = isinstance(w13, Mxfp4Stack)
    if (lib is None or activation not in ACTIVATIONS or x.dim() != 2 or x.dtype not in _DTYPES
            or not x.is_cpu or mxfp4 != isinstance(w2, Mxfp4Stack)
            or len(w13.shape) != 3 or len(w2.shape) != 3):
        return None
    tokens, hidden = x.shape
    experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    fits = _fits_mxfp4 if mxfp4 else _fits
    if (not fits(w13, x.dtype, (experts, 2 * inter, hidden))
            or not fits(w2, x.dtype, (experts, hidden, inter))
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
    head = (x.data_ptr(), int(x.dtype == torch.bfloat16), tokens, hidden)
    tail = (experts, inter, weights.data_ptr(), ids.data_ptr(), int(ids.dtype == torch.int64),
            ids.shape[1], None if w13_bias is None else w13_bias.data_ptr(),
            None if w2_bias is None else w2_bias.data_ptr(), ACTIVATIONS.index(activation),
            float(alpha), float(limit), out.data_ptr(), torch.get_num_threads())
    if mxfp4:
        status = lib.fused_moe_mxfp4_rows(*head, w13.blocks.data_ptr(), w13.scales.data_ptr(),
                                          w2.blocks.data_ptr(), w2.scales.data_ptr(), *tail)
    else:
        status = lib.fused_moe_rows(*head, w13.data_ptr(), w2.data_ptr(), *tail)
    return out if status == 0 else None
