"""A weight matrix in one of GGUF's 32-weight block formats, its values exactly the
file's, its bytes laid out for the kernel.

Supported: Q4_0, Q4_1, Q8_0, whose blocks are 32 weights with fp16 scale(s); the native
kernel (kernels/cpu/linear_quant.c) multiplies them without dequantizing. Per block:
  Q4_0: w = d * u - 8 d      Q4_1: w = d * u + m      Q8_0: w = d * q
(u the 4-bit code, q the int8 code). Loading splits the interleaved file blocks into the
codes (`qs`, the file's nibble order: byte j of a block holds elements j and j + 16),
float32 scales `d` and, for the 4-bit formats, the float32 offset `offset` (m, or -8 d):
the kernel then reads codes without strides and scales without converting fp16 per
block, and both 4-bit formats become one formula, d * u + offset.
The torch dequantization here defines the values; the tests, the embedding lookup's
fallback and hosts without a C compiler use it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
# GGML type name -> (type id, bytes per 32-weight block in the file)
FORMATS = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}


@dataclass(frozen=True)
class GgufWeight:
    """qs: [out, in / 2] uint8 (4-bit) or [out, in] int8 (Q8_0); d, offset: [out, in / 32]
    float32 (offset None for Q8_0)."""
    type_name: str
    qs: torch.Tensor
    d: torch.Tensor
    offset: torch.Tensor | None
    in_features: int

    @property
    def kernel_args(self) -> tuple[int, ...]:
        """(type id, codes, scales, offsets or 0, out, in): the C kernel's weight arguments,
        computed once; a decode step makes ~120 calls, and Python attribute walks add up."""
        args = self.__dict__.get("_kernel_args")
        if args is None:
            args = (FORMATS[self.type_name][0], self.qs.data_ptr(), self.d.data_ptr(),
                    0 if self.offset is None else self.offset.data_ptr(), self.out_features,
                    self.in_features)
            object.__setattr__(self, "_kernel_args", args)
        return args

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.offset)
                   if t is not None)

    @staticmethod
    def from_blocks(type_name: str, blocks: torch.Tensor, in_features: int) -> "GgufWeight":
        """`blocks`: the file's bytes, [out, in / 32 * block bytes] uint8."""
        if type_name not in FORMATS:
            raise ValueError(f"quantization: GGUF type {type_name} is not supported "
                             f"(supported: {', '.join(FORMATS)})")
        block_bytes = FORMATS[type_name][1]
        if in_features % BLOCK or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != in_features // BLOCK * block_bytes:
            raise ValueError(f"quantization: {type_name} rows of {in_features} weights need "
                             f"{in_features // BLOCK * block_bytes} bytes, got "
                             f"{tuple(blocks.shape)} {blocks.dtype}")
        rows = blocks.shape[0]
        b = blocks.reshape(rows, in_features // BLOCK, block_bytes)
        d = b[..., 0:2].contiguous().view(torch.float16).float().reshape(rows, -1)
        if type_name == "Q8_0":
            return GgufWeight(type_name, b[..., 2:].contiguous().view(torch.int8).reshape(rows, -1),
                              d, None, in_features)
        if type_name == "Q4_1":
            offset = b[..., 2:4].contiguous().view(torch.float16).float().reshape(rows, -1)
            qs = b[..., 4:]
        else:
            offset, qs = -8.0 * d, b[..., 2:]
        return GgufWeight(type_name, qs.contiguous().reshape(rows, -1), d, offset, in_features)

    @staticmethod
    def concat(parts: list["GgufWeight"]) -> "GgufWeight":
        """Row-wise (fused q/k/v, gate/up): blocks run along in_features, so rows of one
        format and width stack as they are."""
        first = parts[0]
        if any(p.type_name != first.type_name or p.in_features != first.in_features
               for p in parts):
            raise ValueError("quantization: fused parts differ in format or width")
        offset = None if first.offset is None else torch.cat([p.offset for p in parts])
        return GgufWeight(first.type_name, torch.cat([p.qs for p in parts]),
                          torch.cat([p.d for p in parts]), offset, first.in_features)

    def select_rows(self, index: torch.Tensor) -> "GgufWeight":
        """The weight restricted to some output rows, in `index` order (row permutations)."""
        offset = None if self.offset is None else self.offset[index].contiguous()
        return GgufWeight(self.type_name, self.qs[index].contiguous(), self.d[index].contiguous(),
                          offset, self.in_features)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [rows, in_features] of the selected rows (all by default)."""
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        qs, d = pick(self.qs), pick(self.d).unsqueeze(-1)
        n = qs.shape[0]
        if self.offset is None:
            return (d * qs.reshape(n, -1, BLOCK).float()).reshape(n, -1)
        packed = qs.reshape(n, -1, BLOCK // 2).to(torch.int16)
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()  # j, then j + 16
        return (d * codes + pick(self.offset).unsqueeze(-1)).reshape(n, -1)
