"""The native float32 batch GEMM (kernels/cpu/gemm_f32.c): weights packed once into
16-column panels, then y = x W^T (+ bias) for any row count.

Each function returns None when it does not apply (no library, dtype, layout, device);
kernels.dispatch then keeps oneDNN or torch.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kernels.cpu import native as cpu_native
from kernels.cpu.gguf_weight import GgufWeight

PANEL = 16
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "gemm_f32_preferred": (_I32, []),
    "gemm_f32_pack": (None, [_P, _I64, _I64, _P, _I32]),
    "gemm_f32": (None, [_P, _I64, _I64, _P, _I64, _P, _P, _I32]),
    "gemm_gguf_f32": (_I32, [_I32, _P, _P, _P, _I64, _I64, _P, _I64, _P, _P, _I32]),
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
