"""Hand-built paged batches for model tests and benches (the real model runner lives elsewhere)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.models import AttentionMetadata


@dataclass
class PagedBatchBuilder:
    """Gives each sequence scattered KV blocks and turns per-sequence chunks into the flat
    tensors one forward takes."""
    block_size: int
    num_blocks: int
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    _next_free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Hand blocks out in a shuffled order so a wrong block-table lookup cannot
        # accidentally read the right data.
        gen = torch.Generator().manual_seed(1234)
        self._next_free = torch.randperm(self.num_blocks, generator=gen).tolist()

    def new_kv_caches(self, loaded, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (self.num_blocks, self.block_size, loaded.num_kv_heads, loaded.head_dim)
        return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                for _ in range(loaded.num_layers)]

    def _ensure_blocks(self, seq_id: str, num_tokens: int) -> list[int]:
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self._next_free.pop())
        return table

    def build(self, chunks: list[tuple[str, list[int], int]]
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """chunks: (seq_id, token ids of this step, position of the first one)."""
        ids, positions, slots, seq_lens, qsl, tables = [], [], [], [], [0], []
        for seq_id, tokens, start in chunks:
            end = start + len(tokens)
            table = self._ensure_blocks(seq_id, end)
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size
                             + pos % self.block_size)
            ids.extend(tokens)
            positions.extend(range(start, end))
            seq_lens.append(end)
            qsl.append(qsl[-1] + len(tokens))
            tables.append(table)
        width = max(len(t) for t in tables)
        block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, table in enumerate(tables):
            block_tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=block_tables,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            max_query_len=max(len(c[1]) for c in chunks),
            max_seq_len=max(seq_lens))
        return (torch.tensor(ids, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64), meta)


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """HF's logits for every position of one unpadded sequence, float32 [len, vocab]."""
    with torch.inference_mode():
        out = hf_model(input_ids=torch.tensor([token_ids]), use_cache=False)
    return out.logits[0].float()


def last_logits(loaded, token_ids: list[int]) -> torch.Tensor:
    """Our model's logits for the last position of one sequence, prefilled alone."""
    builder = PagedBatchBuilder(block_size=16, num_blocks=8)
    kv = builder.new_kv_caches(loaded, loaded.dtype)
    ids, positions, meta = builder.build([("S", token_ids, 0)])
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(ids, positions, kv, meta)[-1:])[0]


def run_chunks(loaded, kv, builder: PagedBatchBuilder, chunks) -> torch.Tensor:
    """One forward of `chunks` ((seq, tokens, start) each) through the paged cache ->
    float32 logits of every row."""
    ids, positions, meta = builder.build(chunks)
    with torch.inference_mode():
        hidden = loaded.model(ids, positions, kv, meta)
        assert hidden.shape == (len(ids), loaded.hidden_size)
        return loaded.model.compute_logits(hidden)


def check_bf16_tracks_hf(loaded, hf, token_ids: list[int], atol: float) -> None:
    """bf16 logits of one prefill against HF's own bf16 forward: equally valid roundings
    (the attention kernels differ from HF's eager), so close, not equal, and the same
    greedy choice almost everywhere."""
    builder = PagedBatchBuilder(block_size=4, num_blocks=-(-len(token_ids) // 4) + 2)
    kv = builder.new_kv_caches(loaded, torch.bfloat16)
    logits = run_chunks(loaded, kv, builder, [("S", token_ids, 0)])
    expected = hf_logits(hf, token_ids)
    torch.testing.assert_close(logits, expected, atol=atol, rtol=0.05)
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def check_mixed_batches_match_hf(loaded, hf) -> None:
    """Three sequences through mixed steps (A: prompt then decodes; B: prefill in two
    chunks, the second beside decodes, 13 tokens past a small window; C: prompt then
    decodes): every row's logits within 1e-4 of HF's own forward (float32)."""
    gen = torch.Generator().manual_seed(0)
    seqs = {name: torch.randint(3, 49152, (n,), generator=gen).tolist()
            for name, n in (("A", 9), ("B", 13), ("C", 8))}
    builder = PagedBatchBuilder(block_size=4, num_blocks=24)
    kv = builder.new_kv_caches(loaded, torch.float32)
    # Each step: (seq, start, end) of tokens to run.
    steps = [[("A", 0, 7), ("B", 0, 6), ("C", 0, 5)],
             [("B", 6, 13), ("C", 5, 6), ("A", 7, 8)],
             [("C", 6, 7), ("A", 8, 9)],
             [("C", 7, 8)]]
    reference = {name: hf_logits(hf, toks) for name, toks in seqs.items()}
    # Random weights must still separate positions, or a wrong position would pass.
    assert not torch.allclose(reference["A"][5], reference["A"][6], atol=1e-2)
    for step in steps:
        logits = run_chunks(loaded, kv, builder, [(n, seqs[n][s:e], s) for n, s, e in step])
        expected = torch.cat([reference[n][s:e] for n, s, e in step])
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
