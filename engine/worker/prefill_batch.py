"""The paged-attention inputs of a batch of chunks (prefill, or mixed with decodes): each
token's position and, per KV-cache group, its slot and the sequences' block tables. The
generation runner (engine/worker/model_runner.py) and the pooling one
(engine/pooling/batch.py) both build their steps with it."""
from __future__ import annotations

from typing import Callable

import torch

from engine.models.attention import AttentionMetadata


def padded_table(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one int32 tensor; padding entries point at block 0, and seq_lens
    keeps them from being read."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def chunk_inputs(query_lens: list[int], seq_lens: list[int], block_tables: list[torch.Tensor],
                 block_size: int, upload: Callable[[torch.Tensor], torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
    """Sequence i computes query_lens[i] new tokens ending at seq_lens[i]; `block_tables`:
    one padded table per KV-cache group. Returns the positions [T] and query_start_loc
    [num_seqs + 1] on the host (int64), and one AttentionMetadata per group, its tensors
    passed through `upload`."""
    num_seqs = len(query_lens)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    s_lens = torch.tensor(seq_lens, dtype=torch.int64)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=qsl[1:])
    seq_index = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
    # Position of each token: its sequence's first new position plus its offset.
    positions = (s_lens - q_lens)[seq_index] + (torch.arange(int(qsl[-1])) - qsl[:-1][seq_index])
    block_of, offset = positions // block_size, positions % block_size
    query_start_loc = upload(qsl.to(torch.int32))
    seq_lens_t = upload(s_lens.to(torch.int32))
    metas = [AttentionMetadata(
        slot_mapping=upload(block_table[seq_index, block_of].to(torch.int64) * block_size
                            + offset),
        block_tables=upload(block_table),
        query_start_loc=query_start_loc, seq_lens=seq_lens_t,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
        for block_table in block_tables]
    return positions, qsl, metas
