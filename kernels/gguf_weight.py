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
Where the AVX-512 VNNI kernel serves (kernels.dispatch.prepare_gguf), the same codes and
scales are repacked once into its 16-output panels (`to_panels`, layout "panels"), which
then replace the rows; `to_rows` gives the file's layout back bit-exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
PANEL = 16  # outputs a panel of linear_gguf_vnni.c holds, one per 512-bit lane
PANELS_FLAG = 0x100  # gguf_blocks.h GGUF_VNNI_PANELS: or'd into the type id of panels
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
    layout: str = "rows"     # "rows": the file's; "panels": to_panels's (the VNNI kernel's)
    unpadded_outputs: int | None = None  # panels: out_features (their last panel is padded)

    @property
    def kernel_args(self) -> tuple[int, ...]:
        """(type id, codes, scales, offsets or 0, out, in): the C kernel's weight arguments,
        computed once; a decode step makes ~120 calls, and Python attribute walks add up."""
        args = self.__dict__.get("_kernel_args")
        if args is None:
            args = (self.kernel_type, self.qs.data_ptr(), self.d.data_ptr(),
                    0 if self.offset is None else self.offset.data_ptr(), self.out_features,
                    self.in_features)
            object.__setattr__(self, "_kernel_args", args)
        return args

    @property
    def kernel_type(self) -> int:
        """The C kernels' type id: GGML's, with PANELS_FLAG for the panel layout."""
        return FORMATS[self.type_name][0] | (PANELS_FLAG if self.layout == "panels" else 0)

    @property
    def out_features(self) -> int:
        return self.qs.shape[0] if self.unpadded_outputs is None else self.unpadded_outputs

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
        if any(p.layout != "rows" for p in parts):
            raise ValueError("quantization: fused parts must be in the file's row layout")
        if any(p.type_name != first.type_name or p.in_features != first.in_features
               for p in parts):
            raise ValueError("quantization: fused parts differ in format or width")
        offset = None if first.offset is None else torch.cat([p.offset for p in parts])
        return GgufWeight(first.type_name, torch.cat([p.qs for p in parts]),
                          torch.cat([p.d for p in parts]), offset, first.in_features)

    def select_rows(self, index: torch.Tensor) -> "GgufWeight":
        """The weight restricted to some output rows, in `index` order (row permutations)."""
        if self.layout != "rows":
            return self.to_rows().select_rows(index)
        offset = None if self.offset is None else self.offset[index].contiguous()
        return GgufWeight(self.type_name, self.qs[index].contiguous(), self.d[index].contiguous(),
                          offset, self.in_features)

    def to_panels(self) -> "GgufWeight":
        """The same weight in linear_gguf_vnni.c's layout (layout "panels"): outputs in
        panels of 16, the last padded with zero codes and scales; per panel and block the
        codes as 32-bit lanes, lane j = 4 code bytes of output 16 p + j (Q8_0's as q + 128,
        unsigned); d and Q4_1's offsets as [panel, block, 16] (Q4_0's, -8 d, go into the
        kernel's integer sums)."""
        if self.layout == "panels":
            return self
        n, nblk = self.out_features, self.in_features // BLOCK
        pad = -n % PANEL

        def panels(t: torch.Tensor, words: int) -> torch.Tensor:
            # [n, nblk * words] 32-bit words -> [panel, nblk, words, 16]
            t = torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t
            return t.reshape(-1, PANEL, nblk, words).permute(0, 2, 3, 1).contiguous()

        if self.type_name == "Q8_0":
            codes = panels((self.qs.view(torch.uint8) ^ 0x80).view(torch.int32), BLOCK // 4)
        else:
            codes = panels(self.qs.view(torch.int32), BLOCK // 8)
        offset = (panels(self.offset, 1).reshape(-1, nblk, PANEL)
                  if self.type_name == "Q4_1" else None)
        return GgufWeight(self.type_name, codes.view(torch.uint8).reshape(codes.shape[0], -1),
                          panels(self.d, 1).reshape(-1, nblk, PANEL), offset, self.in_features,
                          layout="panels", unpadded_outputs=n)

    def to_rows(self) -> "GgufWeight":
        """The file's row layout back from panels, bit-exact."""
        if self.layout == "rows":
            return self
        n, nblk = self.out_features, self.in_features // BLOCK
        words = BLOCK // 4 if self.type_name == "Q8_0" else BLOCK // 8

        def unpanel(t: torch.Tensor, words: int) -> torch.Tensor:
            # [panel, nblk, words, 16] -> [n, nblk * words]
            t = t.reshape(-1, nblk, words, PANEL).permute(0, 3, 1, 2)
            return t.reshape(-1, nblk * words)[:n].contiguous()

        codes = unpanel(self.qs.view(torch.int32), words).view(torch.uint8)
        d = unpanel(self.d, 1)
        if self.type_name == "Q8_0":
            return GgufWeight(self.type_name, (codes ^ 0x80).view(torch.int8), d, None,
                              self.in_features)
        offset = unpanel(self.offset, 1) if self.type_name == "Q4_1" else -8.0 * d
        return GgufWeight(self.type_name, codes, d, offset, self.in_features)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [rows, in_features] of the selected rows (all by default)."""
        if self.layout != "rows":
            return self.to_rows().dequantize(rows)
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        qs, d = pick(self.qs), pick(self.d).unsqueeze(-1)
        n = qs.shape[0]
        if self.offset is None:
            return (d * qs.reshape(n, -1, BLOCK).float()).reshape(n, -1)
        packed = qs.reshape(n, -1, BLOCK // 2).to(torch.int16)
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()  # j, then j + 16
        return (d * codes + pick(self.offset).unsqueeze(-1)).reshape(n, -1)
