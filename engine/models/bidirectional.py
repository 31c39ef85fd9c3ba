"""Bidirectional attention over a flat batch of whole sequences, for encoders (BERT):
every token of a sequence sees every token of the same sequence and nothing else. No
KV cache: an encoder computes a prompt in one step and keeps nothing.

Each sequence goes through torch's scaled_dot_product_attention on its own, unmasked.
A padded [B, L] batch with a key mask computes the same and was 1.8x (bf16) to 2.8x
(float32) slower for 14 sequences of 32-256 tokens (bge-small's 12 x 32 heads, AMX host):
a mask keeps the CPU off its fused attention kernel, and padding costs work besides."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class SequenceLayout:
    """Where each sequence's rows start and how many it has, in the flat batch."""
    starts: list[int]
    lens: list[int]

    @classmethod
    def of(cls, seq_lens: list[int], device: torch.device | None = None) -> "SequenceLayout":
        starts, total = [], 0
        for n in seq_lens:
            starts.append(total)
            total += n
        return cls(starts, list(seq_lens))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
           num_heads: int, scale: float) -> torch.Tensor:
    """q/k/v [T, H * D] -> [T, H * D], each sequence attending within itself."""
    T, width = q.shape
    head_dim = width // num_heads
    out = torch.empty_like(q)
    for start, n in zip(layout.starts, layout.lens):
        def heads(x):
            return x[start:start + n].view(1, n, num_heads, head_dim).transpose(1, 2)
        seq = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), scale=scale)
        out[start:start + n] = seq.transpose(1, 2).reshape(n, width)
    return out
