"""Decode steps replayed from CUDA graphs, one graph per padded batch size (vLLM's way).

A decode step of a small model is launch-bound on a GPU: ~10 kernels a layer, each a
few microseconds of work behind more of Python and launch overhead. A captured graph
replays the whole forward in one launch. Graphs fix every tensor's address and shape,
so a step's inputs are copied into static buffers and the batch is padded up to the
next captured size: padding rows write no K/V (slot -1) and attend to nothing
(seq_len 0). Attention is planned for max_model_len, the longest context any step can
have; the partitions past a sequence's end exit at once.

Without capture (a CPU, or a test) `run` executes the same padded batch eagerly, so the
padding itself is tested on every host.

A model of several KV-cache groups (engine/core/kv_cache/groups.py) has a slot mapping
and a block table buffer per group and gets one metadata per layer, its group's.
"""
from __future__ import annotations

import bisect

import torch

from engine.models import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to and including max_num_seqs (vLLM's list)."""
    sizes = {s for s in (1, 2, 4) if s < max_num_seqs} | set(range(8, max_num_seqs, 8))
    return sorted(sizes | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device,
                 layer_groups: tuple[int, ...] | None = None) -> None:
        """`layer_groups`: each layer's KV-cache group; None for a model of one group,
        which gets a single metadata (the fused single-sequence decode reads it)."""
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.layer_groups = layer_groups
        num_groups = 1 if layer_groups is None else max(layer_groups) + 1
        rows, width = self.sizes[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mappings = [torch.full((rows,), -1, dtype=torch.int64, device=device)
                              for _ in range(num_groups)]
        self.group_block_tables = [torch.zeros(rows, width, dtype=torch.int32, device=device)
                                   for _ in range(num_groups)]
        self.slot_mapping, self.block_tables = self.slot_mappings[0], self.group_block_tables[0]
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def padded_size(self, num_seqs: int) -> int | None:
        index = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def _metadata(self, size: int) -> AttentionMetadata | list[AttentionMetadata]:
        metas = [AttentionMetadata(slots[:size], tables[:size], self.query_start_loc[:size + 1],
                                   self.seq_lens[:size], max_query_len=1,
                                   max_seq_len=self.max_model_len)
                 for slots, tables in zip(self.slot_mappings, self.group_block_tables)]
        if self.layer_groups is None:
            return metas[0]
        return [metas[g] for g in self.layer_groups]

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches,
                          self._metadata(size))

    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool.
        Each size runs once eagerly first: kernels compile and allocations settle."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata | tuple[AttentionMetadata, ...]) -> torch.Tensor | None:
        """Hidden states of a decode-only batch, or None when it does not fit the buffers
        (more sequences than captured; the caller runs it eagerly). `meta`: the step's
        metadata, or one per KV-cache group. The result is a view of the graph's output,
        valid until the next run."""
        metas = (meta,) if isinstance(meta, AttentionMetadata) else meta
        num_seqs = input_ids.shape[0]
        size = self.padded_size(num_seqs)
        width = metas[0].block_tables.shape[1]
        if size is None or width > self.block_tables.shape[1]:
            return None
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        for group, slots, tables in zip(metas, self.slot_mappings, self.group_block_tables):
            slots[:num_seqs].copy_(group.slot_mapping)
            slots[num_seqs:size].fill_(-1)
            # Entries past a row's width are stale but never read: positions stay < seq_len.
            tables[:num_seqs, :width].copy_(group.block_tables)
        self.seq_lens[:num_seqs].copy_(metas[0].seq_lens)
        self.seq_lens[num_seqs:size].zero_()
        entry = self._graphs.get(size)
        if entry is None:
            hidden = self._forward(size)
        else:
            entry[0].replay()
            hidden = entry[1]
        return hidden[:num_seqs]
