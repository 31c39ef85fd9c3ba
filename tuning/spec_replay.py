"""Speculative decoding in the replay: who drafts, how many tokens, how many are kept.

A trace recorded with speculative_config (engine/metrics/trace.py) holds per request the
drafts its steps verified, their tokens and the tokens kept. The replay gives each such
request, after every step that gave it tokens (as the engine's Speculator proposes):
  - a draft with probability q: its drafts over the steps that could have drafted (each
    step after its first token that gave it tokens, less the last one when it ended at
    max_tokens, where no room is left for a draft);
  - of its mean recorded length (randomly rounded), cut as the Speculator cuts: at most
    num_speculative_tokens, max_model_len - num_tokens and max_tokens - output - 1;
  - tokens kept ~ Binomial(draft length, a), a = its accepted / drafted tokens, so its
    acceptance rate and tokens per draft are the recorded ones in expectation.
The scheduler then schedules the drafts under its budget (cutting them first, as in the
engine) and gives back the rejected ones' blocks; the step model counts each draft
position as a decode token. Deterministic for a seed. disable_by_batch_size is not
modelled beyond what the recorded rate q holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from engine.api import Request, RequestStatus
from tuning.trace_file import Trace


@dataclass(slots=True)
class DraftRate:
    probability: float  # q: a draft at a step that could draft
    mean_length: float  # recorded draft tokens per draft
    acceptance: float  # a: accepted / drafted tokens


def speculative_config(trace: Trace) -> dict[str, Any] | None:
    """The recorded speculative_config (engine_args), or None without one."""
    config = trace.engine_args.get("speculative_config") or trace.header.get("speculative_config")
    return config or None


def num_speculative_tokens(trace: Trace) -> int:
    """The recorded num_speculative_tokens; for a trace whose header lacks it but whose steps
    drafted, the longest mean draft a step verified (a lower bound); 0: no speculation."""
    config = speculative_config(trace)
    if config is not None:
        return int(config.get("num_speculative_tokens") or 0)
    return max((math.ceil(s["draft_tokens"] / s["num_drafts"]) for s in trace.steps
                if s.get("num_drafts")), default=0)


def draft_rate(record: dict[str, Any]) -> DraftRate | None:
    """A request record's drafting, None where it never drafted (or a version-1 trace)."""
    drafts, tokens = record.get("num_drafts", 0), record.get("draft_tokens", 0)
    if not drafts or not tokens:
        return None
    accepted = record.get("accepted_tokens", 0)
    decode_steps = record["output_len"] - 1 - accepted
    chances = decode_steps - (1 if record.get("finish_reason") == "length" else 0)
    return DraftRate(min(1.0, drafts / max(chances, 1)), tokens / drafts,
                     min(1.0, accepted / tokens))


class Drafter:
    """Proposes and verifies the replayed requests' drafts (see the module's docstring)."""

    def __init__(self, trace: Trace, num_spec_tokens: int, max_model_len: int,
                 seed: int = 0) -> None:
        self.k = num_spec_tokens
        self.max_model_len = max_model_len
        self.rng = np.random.default_rng(seed)
        self.rates = {r["id"]: rate for r in trace.requests
                      if (rate := draft_rate(r)) is not None}
        self.num_drafts = self.draft_tokens = self.accepted_tokens = 0

    @classmethod
    def of(cls, trace: Trace, num_spec_tokens: int, max_model_len: int,
           seed: int = 0) -> "Drafter | None":
        drafter = cls(trace, num_spec_tokens, max_model_len, seed)
        return drafter if num_spec_tokens > 0 and drafter.rates else None

    def propose(self, updated: Iterable[Request]) -> None:
        """After update_from_output: drafts for the requests that got tokens and still run."""
        for request in updated:
            rate = self.rates.get(request.request_id)
            if rate is None or request.status != RequestStatus.RUNNING:
                continue
            limit = min(self.k, self.max_model_len - request.num_tokens,
                        request.max_tokens - request.num_output_tokens - 1)
            if limit <= 0 or self.rng.random() >= rate.probability:
                continue
            whole = math.floor(rate.mean_length)
            length = whole + int(self.rng.random() < rate.mean_length - whole)
            request.spec_token_ids = [0] * min(max(length, 1), limit)

    def sampled(self, request: Request, num_draft: int) -> list[int]:
        """The tokens a step verifying `num_draft` draft tokens gives the request."""
        rate = self.rates.get(request.request_id)
        accepted = int(self.rng.binomial(num_draft, rate.acceptance)) if rate else 0
        self.num_drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += accepted
        return [0] * (accepted + 1)

    def totals(self) -> dict[str, int]:
        return {"num_drafts": self.num_drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens}


def recorded_totals(trace: Trace) -> dict[str, int]:
    """The recorded run's drafts, draft tokens and accepted tokens (its steps' sums)."""
    return {name: sum(s.get(name, 0) for s in trace.steps)
            for name in ("num_drafts", "draft_tokens", "accepted_tokens")}
