"""Batched token sampling: penalties, min_tokens, temperature, min-p, top-k, top-p, seeds, logprobs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_metadata import PenaltyTensors, SamplerState, SamplingMetadata
from engine.request import Request

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    # log_softmax of the raw logits; None when no row asked for logprobs.
    sampled_logprobs: torch.Tensor | None  # [N] float32
    # k = the largest `logprobs` asked for in the batch; None when no row asks or k == 0.
    topk_token_ids: torch.Tensor | None  # [N, k] int64
    topk_logprobs: torch.Tensor | None  # [N, k] float32


class Sampler:
    """Samples one token per row; keeps each seeded request's generator across steps."""

    def __init__(self, seed: int | None = None) -> None:
        self.state = SamplerState()
        # Unseeded rows share one generator per device; a seed here makes whole runs repeatable.
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def prepare(self, requests: list[Request], vocab_size: int,
                device: torch.device | str) -> SamplingMetadata:
        return SamplingMetadata.build(requests, vocab_size, device, self.state)

    def free(self, request_id: str) -> None:
        self.state.free(request_id)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.argmax_only:
            return SamplerOutput(logits.argmax(dim=-1), None, None, None)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        # A private float32 copy: everything below edits it in place.
        logits = logits.to(torch.float32, copy=True)
        if metadata.min_tokens_rows is not None:
            logits.index_put_((metadata.min_tokens_rows, metadata.min_tokens_token_ids),
                              torch.tensor(_NEG_INF, device=logits.device))
        if metadata.penalties is not None:
            logits = apply_penalties(logits, metadata.penalties)
        if metadata.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample(logits, metadata)
        return _with_logprobs(sampled, logprobs, metadata.max_num_logprobs)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy_ids = logits.argmax(dim=-1) if md.greedy_rows is not None else None
        logits.div_(md.temperature.unsqueeze(1))
        if md.min_p is not None:
            apply_min_p(logits, md.min_p)
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race: argmax(p / q), q ~ Exp(1), picks token i with probability p_i,
        # and lets each seeded row draw its own q from its own generator.
        q = torch.empty_like(probs)
        q.exponential_(generator=self._shared_generator(probs.device))
        for row, request_id, seed in md.seeded_rows:
            q[row].exponential_(generator=self.state.generator(request_id, seed, probs.device))
        # q == 0 would turn a masked token's 0/0 into NaN, which argmax would pick.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        sampled = probs.div_(q).argmax(dim=-1)
        if greedy_ids is not None:
            sampled = torch.where(md.greedy_rows, greedy_ids, sampled)
        return sampled

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._shared[device] = gen
        return gen


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> torch.Tensor:
    """vLLM's formulas; column `vocab` of the scratch tensors absorbs the padding ids."""
    n, vocab = logits.shape
    out_ids = pen.output_token_ids
    counts = torch.zeros(n, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, out_ids, torch.ones(out_ids.shape, dtype=logits.dtype,
                                               device=logits.device))
    counts = counts[:, :vocab]
    if pen.any_repetition:
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, pen.prompt_token_ids, True)
        seen = seen[:, :vocab] | (counts > 0)
        scale = torch.where(seen, pen.repetition_penalty.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    if pen.any_presence_or_frequency:
        logits -= pen.frequency_penalty.unsqueeze(1) * counts
        logits -= pen.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drops tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """top_k rows hold vocab_size when off, top_p rows 1.0; ties at the k-th value are kept."""
    if top_p is None:
        # No full sort needed: the k-th largest value per row is the cut-off.
        k_max = int(top_k.max())
        kth = logits.topk(k_max, dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill_(logits < kth, _NEG_INF)
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    vocab = logits.shape[1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    # Drop the low tail whose total mass stays within 1 - p; the top token always survives.
    tail_mass = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = tail_mass <= 1.0 - top_p.unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(1, order, sorted_logits)


def _with_logprobs(sampled: torch.Tensor, logprobs: torch.Tensor | None,
                   k: int | None) -> SamplerOutput:
    if logprobs is None:
        return SamplerOutput(sampled, None, None, None)
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
    if not k:
        return SamplerOutput(sampled, sampled_lp, None, None)
    top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    return SamplerOutput(sampled, sampled_lp, top.indices, top.values)
