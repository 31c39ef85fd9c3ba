"""Bidirectional attention over a flat batch of whole sequences, for encoders (BERT):
every token of a sequence sees every token of the same sequence and nothing else. No
KV cache: an encoder computes a prompt in one step and keeps nothing.

The sequences are scattered into a padded [B, L] layout once per forward (the layout is
the same for every layer) and run through torch's scaled_dot_product_attention with a
key mask, so padding keys never take part; padded query rows are computed and dropped."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class SequenceLayout:
    """Where each flat row sits in the padded batch, and which padded keys are real."""
    num_seqs: int
    max_len: int
    padded_index: torch.Tensor   # [T] int64: row b * max_len + offset of each flat row
    key_mask: torch.Tensor | None  # [B, 1, 1, L] bool, True = a real key; None for B == 1

    @classmethod
    def of(cls, seq_lens: list[int], device: torch.device) -> "SequenceLayout":
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        num_seqs, max_len = len(seq_lens), max(seq_lens)
        seq_index = torch.repeat_interleave(torch.arange(num_seqs), lens)
        starts = torch.cumsum(lens, 0) - lens
        offset = torch.arange(int(lens.sum())) - starts[seq_index]
        padded = (seq_index * max_len + offset).to(device)
        mask = None
        if num_seqs > 1:
            mask = (torch.arange(max_len)[None, :] < lens[:, None]).to(device)[:, None, None, :]
        return cls(num_seqs, max_len, padded, mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SequenceLayout,
           num_heads: int, scale: float) -> torch.Tensor:
    """q/k/v [T, H * D] -> [T, H * D], each sequence attending within itself."""
    T, width = q.shape
    head_dim = width // num_heads
    B, L = layout.num_seqs, layout.max_len
    if B == 1:
        def heads(x):
            return x.view(1, T, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), scale=scale)
        return out.transpose(1, 2).reshape(T, width)

    def padded(x):
        full = x.new_zeros(B * L, width).index_copy_(0, layout.padded_index, x)
        return full.view(B, L, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v),
                                         attn_mask=layout.key_mask, scale=scale)
    return out.transpose(1, 2).reshape(B * L, width).index_select(0, layout.padded_index)
