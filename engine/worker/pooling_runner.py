"""SchedulerOutput -> the pooled vectors of the requests whose prompt it completes.

A decoder runs its own forward over the paged KV cache, prefill chunks only (the same
model call engine/worker/model_runner.py makes, reading the final norm's hidden states
instead of computing logits); its K/V stay in the pool for the request's later chunks
and for prefix-cache hits. An encoder (BERT family) gets whole prompts only and keeps no
KV (engine/pooling/scheduler.py). Each completed request's hidden rows are pooled
(engine/pooling/pooler.py) and go through the embedding or classifier head."""
from __future__ import annotations

from typing import Mapping

import torch

from engine.core.kv_cache.groups import KVCacheLayout
from engine.core.sched_output import SchedulerOutput
from engine.faults import FaultPlan, InjectedFailure
from engine.models.attention import AttentionMetadata
from engine.pooling.batch import StepChunks, paged_inputs, token_types
from engine.pooling.params import PoolingParams
from engine.pooling.pooler import SequencePooler, classifier_head, embedding_head
from engine.pooling.settings import PoolerSettings
from engine.worker import host_memory


class PoolingRunner:
    def __init__(self, loaded, settings: PoolerSettings, num_kv_blocks: int, block_size: int,
                 layout: KVCacheLayout, faults: FaultPlan = FaultPlan()) -> None:
        self.model = loaded.model
        self.settings = settings
        self.device = next(self.model.parameters()).device
        self.dtype = loaded.dtype
        self.is_encoder = bool(getattr(self.model, "is_encoder", False))
        self.block_size = block_size
        self.layout = layout
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if not self.is_encoder:
            shape = (num_kv_blocks, block_size, loaded.num_kv_heads, loaded.head_dim)
            slots = [(host_memory.zeros(shape, loaded.dtype, self.device),
                      host_memory.zeros(shape, loaded.dtype, self.device))
                     for _ in range(layout.group_size)]
            self.kv_caches = [slots[slot] for slot in layout.layer_slot]
        self.pooler = SequencePooler(settings.pooling_type)
        self.fail_at_step = faults.model_step
        self.num_steps = 0

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, params: Mapping[str, PoolingParams],
                segment_starts: Mapping[str, int | None] | None = None
                ) -> dict[str, list[float]]:
        """`params`: each scheduled request's PoolingParams; `segment_starts`: where a
        cross-encoder pair's second segment starts (token type 1), None for one text."""
        # A request finished or aborted since the last step leaves no partial state.
        self.pooler.drop(out.finished_req_ids)
        if not out.scheduled_requests:
            return {}
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise InjectedFailure(f"injected model failure at engine step {self.num_steps}")
        chunks = StepChunks.of(out)
        hidden = self._hidden(out, chunks, segment_starts or {})
        done_ids, pooled = [], []
        row = 0
        for rid, start, n, done, length in zip(chunks.request_ids, chunks.starts, chunks.lens,
                                               chunks.done, chunks.prompt_lens):
            vector = self.pooler.add(rid, hidden[row:row + n], start, done, length)
            row += n
            if vector is not None:
                done_ids.append(rid)
                pooled.append(vector)
        if not done_ids:
            return {}
        return dict(zip(done_ids, self._heads(done_ids, torch.stack(pooled), params)))

    def _hidden(self, out: SchedulerOutput, chunks: StepChunks,
                segment_starts: Mapping[str, int | None]) -> torch.Tensor:
        input_ids = torch.tensor(chunks.token_ids, dtype=torch.int64, device=self.device)
        if self.is_encoder:
            types = token_types(chunks, [segment_starts.get(r) for r in chunks.request_ids],
                                self.device)
            return self.model(input_ids, types, chunks.lens)
        positions, meta = paged_inputs(out, chunks, self.block_size, self.layout.num_groups,
                                       self.device)
        layer_meta = (meta if isinstance(meta, AttentionMetadata)
                      else [meta[g] for g in self.layout.layer_group])
        return self.model(input_ids, positions, self.kv_caches, layer_meta)

    def _heads(self, request_ids: list[str], pooled: torch.Tensor,
               params: Mapping[str, PoolingParams]) -> list[list[float]]:
        settings = self.settings
        if settings.task == "classify":
            logits = self.model.classify(pooled.to(self.dtype))
            return [classifier_head(row.float(), params[rid], settings).tolist()
                    for rid, row in zip(request_ids, logits)]
        return [embedding_head(row, params[rid], settings).tolist()
                for rid, row in zip(request_ids, pooled)]
