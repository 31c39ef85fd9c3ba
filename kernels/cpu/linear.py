"""Native CPU matmuls for few rows (kernels/cpu/linear_f32.c, linear_bf16.c) and for GGUF-quantized
weights (kernels/cpu/linear_quant.c), loaded with the other C kernels (cpu_native).

Each function returns None when it does not apply (no library, dtype, layout, device);
kernels.dispatch then runs the torch path.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kernels.cpu import features as cpu_features
from kernels.cpu import native as cpu_native
from kernels.gguf_weight import GgufWeight

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "linear_f32_rows": (None, [_P, _P, _P, _P, _I64, _I64, _I64, _I32]),
    "linear_bf16_rows": (_I32, [_P, _P, _P, _P, _I64, _I64, _I64, _I32]),
    "linear_bf16_uses_dpbf16": (_I32, []),
    "linear_gguf": (_I32, [_I32, _P, _P, _P, _I64, _I64, _P, _I32, _I64, _P, _P, _I32, _I32]),
    "linear_gguf_rows": (_I32, [_I32, _P, _P, _P, _I64, _I64, _P, _I32, _I64, _P, _P, _I32,
                                _I32]),
    "dequantize_rows_gguf": (_I32, [_I32, _P, _P, _P, _I64, _P, _I64, _P, _I32]),
    "linear_gguf_amx": (_I32, [_I32, _P, _P, _P, _I64, _I64, _P, _I32, _I64, _P, _P, _I32, _I32]),
    "linear_gguf_amx_built": (_I32, []),
    "linear_gguf_amx_ready": (_I32, []),
    "linear_gguf_vnni": (_I32, [_I32, _P, _P, _P, _I64, _I64, _P, _I32, _I64, _P, _P, _I32, _I32]),
    "linear_gguf_vnni_built": (_I32, []),
}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_native.bind(_SIGNATURES)


def available() -> bool:
    return _library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _row_operands_fit(lib, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      dtype: torch.dtype) -> bool:
    """What the dense row kernels take: a 2-D x, W and bias all in `dtype`, on CPU, W and
    bias contiguous."""
    return (lib is not None and x.dim() == 2 and x.dtype == dtype and weight.dtype == dtype
            and x.is_cpu and weight.is_cpu and weight.is_contiguous()
            and (bias is None or (bias.dtype == dtype and bias.is_contiguous())))


def linear_f32_rows(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor | None:
    """x W^T + b for a 2-D float32 x on CPU; None if not applicable."""
    lib = _library()
    if not _row_operands_fit(lib, x, weight, bias, torch.float32):
        return None
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    lib.linear_f32_rows(x.data_ptr(), weight.data_ptr(), _ptr(bias), out.data_ptr(), rows, n, k,
                        torch.get_num_threads())
    return out


def linear_bf16_rows(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor | None:
    """x W^T + b for a 2-D bf16 x and bf16 W (and bias) on CPU, float32 sums; None if not
    applicable."""
    lib = _library()
    if not _row_operands_fit(lib, x, weight, bias, torch.bfloat16):
        return None
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    status = lib.linear_bf16_rows(x.data_ptr(), weight.data_ptr(), _ptr(bias), out.data_ptr(),
                                  rows, n, k, torch.get_num_threads())
    return out if status == 0 else None


def bf16_rows_use_dpbf16() -> bool | None:
    """Whether the loaded build's bf16 row kernel runs AVX-512 BF16's vdpbf16ps (True) or
    widens to float32 and uses FMA (False); None without the library."""
    lib = _library()
    return None if lib is None else bool(lib.linear_bf16_uses_dpbf16())


def linear_gguf(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None,
                single_row_order: bool = False) -> torch.Tensor | None:
    """x W^T + b with W in its GGUF codes (x quantized to int8 per 32-block inside the
    kernel, as llama.cpp does), output in x's dtype; None if not applicable.
    `single_row_order`: every row summed as a lone row is (no 4-row tiles), so a row's
    result does not depend on how many rows come with it."""
    lib = _library()
    # is_cpu, not device.type, and sizes as arguments: ~120 calls a decode step, where
    # building device objects and shape tuples costs more than the small layers' math.
    if (lib is None or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16)
            or not x.is_cpu or x.shape[1] != weight.in_features
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
    is_bf16 = int(x.dtype == torch.bfloat16)
    kernel = lib.linear_gguf_rows if single_row_order else lib.linear_gguf
    status = kernel(*weight.kernel_args, x.data_ptr(), is_bf16, x.shape[0], _ptr(bias),
                    out.data_ptr(), is_bf16, torch.get_num_threads())
    return out if status == 0 else None


def gguf_vnni_built() -> bool | None:
    """Whether the loaded build carries the AVX-512 VNNI GGUF kernel (linear_gguf_vnni.c,
    built where the compiler targets VNNI: the CPU has it and no cap hides it); None
    without the library."""
    lib = _library()
    return None if lib is None else bool(lib.linear_gguf_vnni_built())


def gguf_amx_built() -> bool | None:
    """Whether the loaded build carries the AMX GGUF kernel (linear_gguf_amx.c); None
    without the library."""
    lib = _library()
    return None if lib is None else bool(lib.linear_gguf_amx_built())


@lru_cache(maxsize=1)
def gguf_amx_available() -> bool:
    """The AMX GGUF kernel can run: the CPU in use (the TLE_CPU_ISA cap applied) is at the
    amx level, the build has the tile code, and Linux granted this process the tile state."""
    lib = _library()
    return (lib is not None and cpu_features.detect().isa == "amx"
            and bool(lib.linear_gguf_amx_built()) and lib.linear_gguf_amx_ready() == 0)


def linear_gguf_amx(x: torch.Tensor, weight: GgufWeight,
                    bias: torch.Tensor | None) -> torch.Tensor | None:
    """x W^T + b on AMX tiles: W widened to bf16 a block of rows at a time, x rounded to
    bf16 (float32 x included), float32 sums; output in x's dtype. None if not applicable
    (no AMX, a 1-D x, a bias not float32)."""
    lib = _library()
    if (lib is None or not gguf_amx_available() or weight.layout != "rows" or x.dim() != 2
            or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu
            or x.shape[1] != weight.in_features or x.shape[0] == 0
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
    is_bf16 = int(x.dtype == torch.bfloat16)
    status = lib.linear_gguf_amx(*weight.kernel_args, x.data_ptr(), is_bf16, x.shape[0],
                                 _ptr(bias), out.data_ptr(), is_bf16, torch.get_num_threads())
    return out if status == 0 else None


def dequantize_rows(weight: GgufWeight, row_ids: torch.Tensor | None) -> torch.Tensor | None:
    """float32 [len(row_ids), in_features]: rows of a quantized table (an embedding lookup;
    the caller checks the ids are in range), or the whole table when row_ids is None."""
    lib = _library()
    if lib is None or not weight.qs.is_cpu:
        return None
    ids = None if row_ids is None else row_ids.to(torch.int64).contiguous()
    rows = weight.out_features if ids is None else ids.numel()
    out = torch.empty(rows, weight.in_features, dtype=torch.float32)
    status = lib.dequantize_rows_gguf(weight.kernel_type, weight.qs.data_ptr(),
                                      weight.d.data_ptr(), _ptr(weight.offset), weight.in_features,
                                      _ptr(ids), rows, out.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None
