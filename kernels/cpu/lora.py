"""The native segmented LoRA update (kernels/cpu/lora_sgmv.c), loaded with the other C
kernels (cpu_native). `lora_add` returns False where it does not apply (no library,
dtype, layout); kernels.dispatch then runs the torch path (kernels/lora_ops.py)."""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kernels.cpu import native as cpu_native
from kernels.lora_ops import LoRASegments, SegmentWeights

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_DTYPES = (torch.float32, torch.bfloat16)


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_native.bind({"lora_sgmv": (_I32, [_I32, _P, _I64, _P, _I64, _P, _P, _I32, _P,
                                                 _P, _P, _I64, _I64, _I32])})


def lora_add(x: torch.Tensor, y: torch.Tensor, segments: LoRASegments,
             weights: SegmentWeights) -> bool:
    """y[rows of g] += (x[rows of g] A_g^T) B_g^T in place; False if not applicable."""
    lib = _library()
    dtype = x.dtype
    if (lib is None or dtype not in _DTYPES or y.dtype != dtype or x.dim() != 2 or y.dim() != 2
            or not x.is_cpu or x.stride(1) != 1 or y.stride(1) != 1
            or not segments.rows.is_cpu):
        return False
    n = segments.num_segments
    a_ptrs, b_ptrs = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
    ranks = (ctypes.c_int32 * n)()
    for g, ab in enumerate(weights):
        if ab is None:
            continue
        a, b = ab
        rank = a.shape[0]
        if (a.shape[1], b.shape[0], b.shape[1]) != (x.shape[1], y.shape[1], rank):
            return False
        # A row-major; B column-major (B^T's rows contiguous: kernels/lora_ops.py).
        if (a.dtype != dtype or b.dtype != dtype or not a.is_contiguous()
                or not b.t().is_contiguous()):
            return False
        a_ptrs[g], b_ptrs[g], ranks[g] = a.data_ptr(), b.data_ptr(), rank
    status = lib.lora_sgmv(int(dtype == torch.bfloat16), x.data_ptr(), x.stride(0),
                           y.data_ptr(), y.stride(0), segments.rows.data_ptr(),
                           segments.starts.data_ptr(), n, a_ptrs, b_ptrs, ranks, x.shape[1],
                           y.shape[1], torch.get_num_threads())
    return status == 0
