"""Batch-invariant sampling: every request's row sampled on its own, as a [1, vocab] batch.

Why: torch's CPU reductions (log_softmax, logsumexp, the inverse-CDF cumsum) and element-
wise passes split a [N, vocab] tensor into chunks by its total size, so a row's sums and
its vectorised/scalar tail could round differently with N. Alone, a row always meets the
same split. The per-row outputs are joined back into one SamplerOutput.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.sample.metadata import SamplingMetadata


def join_rows(outputs: list, output_type: type):
    """Rows' SamplerOutputs -> one; logprob fields padded where rows asked for fewer (top-k
    ids -1, values -inf; the runner reads each row's own k) or none (nan, rank 0)."""
    sampled = torch.cat([o.sampled_token_ids for o in outputs])
    with_lp = [o for o in outputs if o.sampled_logprobs is not None]
    if not with_lp:
        return output_type(sampled, None, None, None)
    device = sampled.device
    k = max((o.topk_token_ids.shape[1] for o in with_lp if o.topk_token_ids is not None),
            default=0)
    chosen, ranks, top_ids, top_vals = [], [], [], []
    for o in outputs:
        if o.sampled_logprobs is None:
            chosen.append(torch.full((1,), float("nan"), device=device))
            ranks.append(torch.zeros(1, dtype=torch.long, device=device))
        else:
            chosen.append(o.sampled_logprobs)
            ranks.append(o.sampled_ranks)
        ids = torch.full((1, k), -1, dtype=torch.long, device=device)
        vals = torch.full((1, k), float("-inf"), device=device)
        if o.topk_token_ids is not None:
            width = o.topk_token_ids.shape[1]
            ids[:, :width], vals[:, :width] = o.topk_token_ids, o.topk_logprobs
        top_ids.append(ids)
        top_vals.append(vals)
    if k == 0:
        return output_type(sampled, torch.cat(chosen), None, None, torch.cat(ranks))
    return output_type(sampled, torch.cat(chosen), torch.cat(top_ids), torch.cat(top_vals),
                       torch.cat(ranks))


def sample_each_row(sample_one: Callable[[torch.Tensor, SamplingMetadata], object],
                    logits: torch.Tensor, rows: list[SamplingMetadata]):
    """(outputs in row order, ids of the requests whose row raised)."""
    outputs, failed, first_error = [], [], None
    for row, metadata in enumerate(rows):
        try:
            outputs.append(sample_one(logits[row:row + 1], metadata))
        except Exception as exc:  # noqa: BLE001 - the row alone is at fault; named below
            failed.append(metadata.requests[0].request_id)
            first_error = first_error or exc
    return outputs, failed, first_error
