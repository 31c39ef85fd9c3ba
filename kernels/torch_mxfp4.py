"""MXFP4 (OCP Microscaling: FP4 E2M1 values sharing one E8M0 scale per 32), the format
gpt-oss checkpoints store their experts in, and its dequantization: the definition the
native kernel (kernels/cpu/moe_mxfp4.c) is tested against.

A weight [rows, cols] (cols a multiple of 32) is `blocks` uint8 [rows, cols // 32, 16]
and `scales` uint8 [rows, cols // 32]. Value c of a row, in block b = c // 32, is

    FP4_VALUES[nibble] * 2 ** (scales[b] - 127)

with nibble the low four bits of byte (c % 32) // 2 of block b for even c, the high four
for odd c. E2M1: sign bit 3, two exponent bits (bias 1), one mantissa bit, so the
magnitudes 0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6. Every such value times a power of two
is exact in bf16 and float32 wherever it stays in their range, so dequantizing to either
loses nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # values per scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in dtype."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4: blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} are not [..., G, 16] and [..., G]")
    table = torch.tensor(FP4_VALUES, dtype=torch.float64, device=blocks.device)
    low, high = table[(blocks & 15).long()], table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32], in order
    # 2 ** (s - 127) built from a float64's exponent bits (every s is a normal float64),
    # and float64 holds every product exactly: the one rounding is to dtype's range
    scale = ((scales.long() - 127 + 1023) << 52).view(torch.float64)
    values = values * scale[..., None]
    return values.flatten(-2).to(dtype)


@dataclass(slots=True)
class Mxfp4Stack:
    """A stack of MXFP4 weights, [E, rows, cols] as a dense stack would be: blocks uint8
    [E, rows, cols // 32, 16], scales uint8 [E, rows, cols // 32]. It indexes like the
    dense stack, one expert at a time (`stack[e]` is expert e's [rows, cols] dequantized to
    `dtype`), so kernels/torch_moe.fused_moe runs on it unchanged and holds one expert's
    dense copy at a time."""
    blocks: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype  # what an expert dequantizes to: the activations' dtype

    @property
    def shape(self) -> torch.Size:
        experts, rows, groups, _ = self.blocks.shape
        return torch.Size((experts, rows, groups * BLOCK))

    def __getitem__(self, expert: int) -> torch.Tensor:
        if not isinstance(expert, int):  # whole experts only: never a dense copy of more
            raise TypeError(f"Mxfp4Stack: index one expert by int, got {expert!r}")
        return dequantize(self.blocks[expert], self.scales[expert], self.dtype)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes
