"""A pooling step's inputs: each scheduled request's chunk of prompt tokens, back to
back, and for a decoder the paged-attention metadata that writes their K/V and attends
over the request's cached context. A pooling step is prefill only (no request ever
decodes), so this is the prefill half of engine/worker/model_runner.py's batch, built by
the same engine/worker/prefill_batch.py, without the sampling rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.sched_output import SchedulerOutput
from engine.models.attention import AttentionMetadata
from engine.worker.prefill_batch import chunk_inputs, padded_table


@dataclass(slots=True)
class StepChunks:
    """Per scheduled request, in batch order: where its chunk starts in its prompt and
    how long it is; the flat token ids of all chunks."""
    request_ids: list[str]
    starts: list[int]
    lens: list[int]
    done: list[bool]        # the chunk ends the prompt: the request pools this step
    prompt_lens: list[int]
    token_ids: list[int]

    @classmethod
    def of(cls, out: SchedulerOutput) -> "StepChunks":
        chunks = cls([], [], [], [], [], [])
        for request in out.scheduled_requests:
            n = out.num_scheduled_tokens[request.request_id]
            end = request.num_computed_tokens  # counts this step's tokens already
            chunks.request_ids.append(request.request_id)
            chunks.starts.append(end - n)
            chunks.lens.append(n)
            chunks.done.append(end >= request.num_tokens)
            chunks.prompt_lens.append(request.num_tokens)
            chunks.token_ids.extend(request.all_token_ids[end - n:end])
        return chunks


def paged_inputs(out: SchedulerOutput, chunks: StepChunks, block_size: int, num_groups: int,
                 device: torch.device
                 ) -> tuple[torch.Tensor, AttentionMetadata | tuple[AttentionMetadata, ...]]:
    """Positions [T] and the attention metadata (one per KV-cache group; a bare one for a
    model of one group, as the models take it)."""
    tables = [padded_table([out.block_ids[rid][group] for rid in chunks.request_ids])
              for group in range(num_groups)]
    seq_lens = [start + n for start, n in zip(chunks.starts, chunks.lens)]
    positions, _, metas = chunk_inputs(chunks.lens, seq_lens, tables, block_size,
                                       lambda t: t.to(device))
    return positions.to(device), metas[0] if num_groups == 1 else tuple(metas)


def token_types(chunks: StepChunks, segment_starts: list[int | None],
                device: torch.device) -> torch.Tensor:
    """[T] token-type ids for an encoder step: 0, then 1 from each request's second
    segment on (a cross-encoder pair; vLLM keeps the same one boundary per prompt)."""
    types: list[int] = []
    for n, second in zip(chunks.lens, segment_starts):
        first = n if second is None else min(second, n)
        types.extend([0] * first + [1] * (n - first))
    return torch.tensor(types, dtype=torch.int64, device=device)
