"""Batched token sampling: grammar masks, penalties, min_tokens, temperature, min-p, top-k,
top-p, seeds, logprobs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.structured_output.bitmask import apply_bitmask
from engine.core.request import Request
from engine.sample.metadata import PenaltyTensors, SamplerState, SamplingMetadata
from engine.sample.rowwise import join_rows, sample_each_row
from kernels import dispatch

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    # log_softmax of the raw logits; None when no row asked for logprobs.
    sampled_logprobs: torch.Tensor | None  # [N] float32
    # k = the largest `logprobs` asked for in the batch; None when no row asks or k == 0.
    topk_token_ids: torch.Tensor | None  # [N, k] int64
    topk_logprobs: torch.Tensor | None  # [N, k] float32
    # The sampled token's 1-based rank over the vocabulary (vLLM's: how many logprobs are
    # >= its own); None with sampled_logprobs.
    sampled_ranks: torch.Tensor | None = None  # [N] int64


class SamplingError(RuntimeError):
    """Sampling raised for a batch. `failed_request_ids`: the rows that fail on their own
    too, so only they need to fail; empty when no single row does (the batch is at fault)."""

    def __init__(self, message: str, failed_request_ids: list[str]) -> None:
        super().__init__(message)
        self.failed_request_ids = failed_request_ids


class Sampler:
    """Samples one token per row; keeps each seeded request's generator across steps.

    Rows are independent, so one request's parameters must never fail the batch. Inputs
    are made safe when the metadata is built; should something still raise, each row is
    re-run alone to name the culprits (only on that failure path: the batch pays nothing).
    The logits are the call's own: structured-output rows are masked in them in place."""

    def __init__(self, seed: int | None = None, batch_invariant: bool = False) -> None:
        self.state = SamplerState()
        # Each row sampled alone (engine/sample/rowwise.py): prepare() then returns a
        # list with one SamplingMetadata a request.
        self.batch_invariant = batch_invariant
        # Unseeded rows share one generator per device; a seed here makes whole runs repeatable.
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def prepare(self, requests: list[Request], vocab_size: int,
                device: torch.device | str) -> SamplingMetadata | list[SamplingMetadata]:
        try:
            if self.batch_invariant:
                return [SamplingMetadata.build([r], vocab_size, device, self.state)
                        for r in requests]
            return SamplingMetadata.build(requests, vocab_size, device, self.state)
        except Exception as exc:
            failed = _rows_failing_alone(requests, vocab_size, device, None)
            raise SamplingError(f"{type(exc).__name__}: {exc}", failed) from exc

    def free(self, request_id: str) -> None:
        self.state.free(request_id)

    def __call__(self, logits: torch.Tensor,
                 metadata: SamplingMetadata | list[SamplingMetadata]) -> SamplerOutput:
        if isinstance(metadata, list):
            outputs, failed, error = sample_each_row(self._sample_batch, logits, metadata)
            if failed:
                raise SamplingError(f"{type(error).__name__}: {error}", failed) from error
            return join_rows(outputs, SamplerOutput)
        try:
            return self._sample_batch(logits, metadata)
        except Exception as exc:
            failed = _rows_failing_alone(metadata.requests, metadata.vocab_size, logits.device,
                                         logits)
            raise SamplingError(f"{type(exc).__name__}: {exc}", failed) from exc

    def _sample_batch(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.argmax_only:
            # A fused bf16 argmax skips upcasting [N, vocab] logits (~3x faster on CPU).
            if metadata.grammar_rows is not None:
                # In place (see the class docstring): copying the rows cost as much again
                # as masking them.
                apply_bitmask(logits, metadata.grammar_bitmask, metadata.grammar_rows)
            return SamplerOutput(dispatch.argmax_rows(logits), None, None, None)
        logits, logprobs = _masked(logits, metadata, metadata.max_num_logprobs is not None)
        if metadata.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample(logits, metadata)
        return _with_logprobs(sampled, logprobs, metadata.max_num_logprobs)

    def target_probs(self, logits: torch.Tensor,
                     metadata: SamplingMetadata | list[SamplingMetadata]) -> torch.Tensor:
        """[N, vocab] float32: the distribution each row's token is drawn from (masks,
        penalties, temperature, min-p, top-k/top-p applied), which speculative decoding's
        rejection sampling weighs a draft model's proposals against. Draws nothing, so
        no generator advances. Greedy rows: the softmax of their masked logits."""
        if isinstance(metadata, list):
            return torch.cat([self.target_probs(logits[row:row + 1], md)
                              for row, md in enumerate(metadata)])
        logits, _ = _masked(logits, metadata, False)
        if not metadata.all_greedy:
            _shape(logits, metadata)
        return torch.softmax(logits, dim=-1)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy_ids = logits.argmax(dim=-1) if md.greedy_rows is not None else None
        _shape(logits, md)
        # Inverse-CDF sampling needs one uniform per row, so a seeded row draws from its own
        # generator and its result does not depend on the rest of the batch.
        device = logits.device
        uniform = torch.rand(md.num_rows, 1, generator=self.shared_generator(device), device=device)
        for row, generator in md.seeded_rows:
            uniform[row] = torch.rand(1, generator=generator, device=device)
        sampled = sample_from_logits(logits, uniform)
        if greedy_ids is not None:
            sampled = torch.where(md.greedy_rows, greedy_ids, sampled)
        return sampled

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """What unseeded rows draw from (rejection sampling too)."""
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._shared[device] = gen
        return gen


def _masked(logits: torch.Tensor, metadata: SamplingMetadata, with_logprobs: bool
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A private float32 copy (what follows edits it in place) with the grammar's mask,
    min_tokens' mask and the penalties applied; and the logprobs asked for, taken after
    the grammar's mask (as in vLLM: a constrained row's logprobs are over what it may
    emit) and before the rest."""
    logits = logits.to(torch.float32, copy=True)
    if metadata.grammar_rows is not None:
        apply_bitmask(logits, metadata.grammar_bitmask, metadata.grammar_rows)
    logprobs = torch.log_softmax(logits, dim=-1) if with_logprobs else None
    if metadata.min_tokens_rows is not None:
        logits.index_put_((metadata.min_tokens_rows, metadata.min_tokens_token_ids),
                          torch.tensor(_NEG_INF, device=logits.device))
    if metadata.penalties is not None:
        logits = apply_penalties(logits, metadata.penalties)
    return logits, logprobs


def _shape(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """In place: temperature, min-p, top-k and top-p (greedy rows have temperature 1)."""
    logits.div_(md.temperature.unsqueeze(1))
    if md.min_p is not None:
        apply_min_p(logits, md.min_p)
    if md.top_k is not None or md.top_p is not None:
        apply_top_k_top_p(logits, md.top_k, md.top_p)


def _rows_failing_alone(requests: list[Request], vocab_size: int, device: torch.device | str,
                        logits: torch.Tensor | None) -> list[str]:
    """Ids of the requests whose row fails on its own (built, and sampled from its own
    logits when given). Fresh state throughout: a probe must not advance the generator
    a seeded request keeps in the real sampler."""
    probe = Sampler(seed=0)
    failed = []
    for row, request in enumerate(requests):
        try:
            metadata = SamplingMetadata.build([request], vocab_size, device)
            if logits is not None:
                probe._sample_batch(logits[row:row + 1], metadata)
        except Exception:  # noqa: BLE001 - any failure of this row alone names it
            failed.append(request.request_id)
    return failed


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
    """Drops tokens with probability < min_p * top probability, compared in log space
    (p_i / p_max = exp(l_i - l_max)) so no softmax pass is needed."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> None:
    """In place. top_k rows hold vocab_size when off, top_p rows 1.0. Both become a per-row
    cut-off logit (ties with it survive), found among the top candidates when the nucleus
    fits there, so the full-vocabulary sort (slow on CPU) is only a fallback."""
    vocab = logits.shape[1]
    limited = top_k is not None and bool((top_k < vocab).any())
    k_max = int(top_k.masked_fill(top_k >= vocab, 0).max()) if limited else 0
    if top_p is None:
        if not limited:
            return
        kth = logits.topk(k_max, dim=-1).values.gather(1, (top_k.clamp(max=k_max) - 1).unsqueeze(1))
        kth.masked_fill_((top_k >= vocab).unsqueeze(1), _NEG_INF)
        logits.masked_fill_(logits < kth, _NEG_INF)
        return
    num_candidates = min(vocab, max(k_max, _TOP_P_CANDIDATES))
    candidates = logits.topk(num_candidates, dim=-1).values  # descending
    if limited:
        kth = candidates.gather(1, (top_k.clamp(max=num_candidates) - 1).unsqueeze(1))
        kth.masked_fill_((top_k >= vocab).unsqueeze(1), _NEG_INF)
        logits.masked_fill_(logits < kth, _NEG_INF)
        candidates.masked_fill_(candidates < kth, _NEG_INF)
    # Top-p renormalises over what top-k kept, so the denominator comes from the masked row.
    log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    cutoff, decided = _nucleus_cutoff(candidates, log_norm, top_p)
    if not bool(decided.all()):
        rows = (~decided).nonzero().squeeze(1)
        full = logits[rows].sort(dim=-1, descending=True).values
        cutoff[rows] = _nucleus_cutoff(full, log_norm[rows], top_p[rows])[0]
    logits.masked_fill_(logits < cutoff, _NEG_INF)


# Enough for the nucleus of a typical LLM distribution at p ~ 0.9; flatter rows fall back.
_TOP_P_CANDIDATES = 256


def _nucleus_cutoff(desc_logits: torch.Tensor, log_norm: torch.Tensor,
                    top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest logit of the nucleus: a token stays if the mass ranked above it is < p.
    `decided` is False where the candidates hold less than p, so the cut may lie beyond them."""
    probs = (desc_logits - log_norm).exp()
    mass_above = probs.cumsum(dim=-1) - probs
    p = top_p.unsqueeze(1)
    # The top token has 0 mass above it, so this is >= 1 for any p > 0 on a row without
    # nan; the clamp covers the rest (p = 0 once gathered index -1 for the whole batch).
    num_kept = (mass_above < p).sum(dim=-1, keepdim=True).clamp_(min=1)
    cutoff = desc_logits.gather(1, num_kept - 1)
    cutoff.masked_fill_(p >= 1.0, _NEG_INF)
    decided = (probs.sum(dim=-1) >= top_p) | (top_p >= 1.0)
    return cutoff, decided


def sample_from_logits(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse CDF per row: the first token whose running weight exceeds u * total.
    `uniform` is [N, 1] in [0, 1); -inf logits have zero weight and are never picked."""
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp_()
    running = weights.cumsum_(dim=-1)
    picked = torch.searchsorted(running, uniform * running[:, -1:], right=True)
    picked = picked.clamp_(max=logits.shape[1] - 1).squeeze(1)
    # Rounding can land u * total on the total itself, past the last live token.
    dead = logits.gather(1, picked.unsqueeze(1)).squeeze(1) == _NEG_INF
    return torch.where(dead, logits.argmax(dim=-1), picked)


def _with_logprobs(sampled: torch.Tensor, logprobs: torch.Tensor | None,
                   k: int | None) -> SamplerOutput:
    if logprobs is None:
        return SamplerOutput(sampled, None, None, None)
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
    ranks = (logprobs >= sampled_lp.unsqueeze(1)).sum(dim=-1)
    if not k:
        return SamplerOutput(sampled, sampled_lp, None, None, ranks)
    top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    return SamplerOutput(sampled, sampled_lp, top.indices, top.values, ranks)
