"""The native batch GEMMs: float32 (kernels/cpu/gemm_f32.c) and bf16 on AVX-512 BF16
(kernels/cpu/gemm_bf16.c), weights packed once into 16-column panels, then
y = x W^T (+ bias) for any row count.

Each function returns None when it does not apply (no library, dtype, layout, device);
kernels.dispatch then keeps oneDNN or torch.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kernels.cpu import native as cpu_native
from kernels.gguf_weight import GgufWeight

PANEL = 16
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "gemm_f32_preferred": (_I32, []),
    "gemm_f32_pack": (None, [_P, _I64, _I64, _P, _I32]),
    "gemm_f32": (None, [_P, _I64, _I64, _P, _I64, _P, _P, _I32]),
    "gemm_gguf_f32": (_I32, [_I32, _P, _P, _P, _I64, _I64, _P, _I64, _P, _P, _I32]),
    "gemm_bf16_built": (_I32, []),
    "gemm_bf16_pack": (None, [_P, _I64, _I64, _P, _I32]),
    "gemm_bf16": (_I32, [_P, _I64, _I64, _P, _I64, _P, _P, _I32]),
    "gemm_bf16_amx_built": (_I32, []),
    "gemm_bf16_amx": (_I32, [_P, _I64, _I64, _P, _I64, _P, _P, _I32]),
    "gemm_bf16_amx_silu": (_I32, [_P, _I64, _I64, _P, _I64, _P, _P, _I32]),
}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_native.bind(_SIGNATURES)


@lru_cache(maxsize=1)
def preferred() -> bool:
    """Whether the loaded build's GEMM is the one to serve fp32 batches with (AVX2 + FMA
    builds without AVX-512, where it was measured against oneDNN)."""
    lib = _library()
    return lib is not None and bool(lib.gemm_f32_preferred())


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """[out, in] float32 CPU weight -> its panels [ceil(out / 16), in, 16], or None."""
    lib = _library()
    if (lib is None or weight.dim() != 2 or weight.dtype != torch.float32
            or not weight.is_cpu):
        return None
    weight = weight.detach().contiguous()
    n, k = weight.shape
    panels = torch.empty(-(-n // PANEL), k, PANEL, dtype=torch.float32)
    lib.gemm_f32_pack(weight.data_ptr(), n, k, panels.data_ptr(), torch.get_num_threads())
    return panels


def unpack(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The [out, in] float32 weight that `pack` was given, bit for bit (re-sharding and
    fallbacks: serving keeps only the panels)."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:out_features].contiguous()


def gemm(x: torch.Tensor, panels: torch.Tensor, out_features: int,
         bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [rows, in] float32 times the packed weight (+ bias [out] float32) -> [rows, out],
    or None if not applicable."""
    lib = _library()
    if (lib is None or x.dim() != 2 or x.dtype != torch.float32 or not x.is_cpu
            or x.shape[1] != panels.shape[1]
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return None
    x = x.contiguous()
    rows, k = x.shape
    out = torch.empty(rows, out_features, dtype=torch.float32)
    lib.gemm_f32(x.data_ptr(), rows, k, panels.data_ptr(), out_features,
                 None if bias is None else bias.data_ptr(), out.data_ptr(),
                 torch.get_num_threads())
    return out


def gemm_gguf(x: torch.Tensor, weight: GgufWeight,
              bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [rows, in] float32 times W in GGUF blocks, widened a panel at a time to float32
    inside the kernel (+ bias [out] float32) -> [rows, out] float32, or None."""
    lib = _library()
    if (lib is None or weight.layout != "rows" or x.dim() != 2 or x.dtype != torch.float32
            or not x.is_cpu or x.shape[1] != weight.in_features
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    type_id, qs, d, offset, n, k = weight.kernel_args
    status = lib.gemm_gguf_f32(type_id, qs, d, offset or None, n, k, x.data_ptr(), x.shape[0],
                               None if bias is None else bias.data_ptr(), out.data_ptr(),
                               torch.get_num_threads())
    return out if status == 0 else None


def bf16_built() -> bool | None:
    """Whether the loaded build carries the AVX-512 BF16 GEMM (gemm_bf16.c, built where the
    compiler targets AVX512_BF16: the CPU has it and no cap hides it); None without the
    library."""
    lib = _library()
    return None if lib is None else bool(lib.gemm_bf16_built())


def pack_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """[out, in] bf16 CPU weight -> its panels [pairs * 2, ceil(in / 2), 16, 2] (pairs =
    ceil(out / 32), zero-padded), or None."""
    lib = _library()
    if (lib is None or weight.dim() != 2 or weight.dtype != torch.bfloat16
            or not weight.is_cpu):
        return None
    weight = weight.detach().contiguous()
    n, k = weight.shape
    panels = torch.empty(-(-n // (2 * PANEL)) * 2, -(-k // 2), PANEL, 2, dtype=torch.bfloat16)
    lib.gemm_bf16_pack(weight.data_ptr(), n, k, panels.data_ptr(), torch.get_num_threads())
    return panels


def unpack_bf16(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The [out, in] bf16 weight that `pack_bf16` was given, bit for bit."""
    wide = panels.permute(0, 2, 1, 3).reshape(panels.shape[0] * PANEL, -1)
    return wide[:out_features, :in_features].contiguous()


@lru_cache(maxsize=1)
def bf16_amx_built() -> bool | None:
    """Whether the loaded build carries the AMX tile GEMM on the same panels (gemm_bf16.c's
    gemm_bf16_amx, built where the compiler targets AMX-BF16); None without the library.
    Cached like the library: dispatch.linear asks on every bf16 batch matmul."""
    lib = _library()
    return None if lib is None else bool(lib.gemm_bf16_amx_built())


def gemm_bf16(x: torch.Tensor, panels: torch.Tensor, out_features: int,
              bias: torch.Tensor | None, tiles: bool = False) -> torch.Tensor | None:
    """x [rows, in] bf16 times the bf16 panels (+ bias [out] bf16) -> [rows, out] bf16,
    float32 sums; None if not applicable (no kernel in this build, dtypes, an odd `in`).
    `tiles`: on AMX tiles (gemm_bf16_amx; also None where `in` is not a multiple of 32 or
    Linux refused the tile state)."""
    lib = _library()
    if (lib is None or x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_cpu
            or x.shape[1] != 2 * panels.shape[1]
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))):
        return None
    x = x.contiguous()
    rows, k = x.shape
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    kernel = lib.gemm_bf16_amx if tiles else lib.gemm_bf16
    status = kernel(x.data_ptr(), rows, k, panels.data_ptr(), out_features,
                    None if bias is None else bias.data_ptr(), out.data_ptr(),
                    torch.get_num_threads())
    return out if status == 0 else None


def gemm_bf16_silu(x: torch.Tensor, panels: torch.Tensor, inter: int,
                   bias: torch.Tensor | None) -> torch.Tensor | None:
    """silu_mul(x [rows, in] times the panels of the MLP's [gate; up] weight, 2 * inter
    outputs (+ bias)) -> [rows, inter] bf16 on AMX tiles in one pass: the bits of
    gemm_bf16(..., tiles=True) then silu_mul, without the [rows, 2 * inter] product in
    memory. None where it does not apply (no such build, dtypes, `in` not a multiple of 32,
    inter not a multiple of 32, Linux refused the tile state)."""
    lib = _library()
    if (lib is None or x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_cpu
            or x.shape[1] != 2 * panels.shape[1] or inter % 32
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))):
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], inter, dtype=torch.bfloat16)
    status = lib.gemm_bf16_amx_silu(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(),
                                    inter, None if bias is None else bias.data_ptr(),
                                    out.data_ptr(), torch.get_num_threads())
    return out if status == 0 else None
