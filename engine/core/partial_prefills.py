"""Concurrent partial-prefill limits (vLLM V0's max_num_partial_prefills and
max_long_partial_prefills; V1 accepts the arguments and ignores them).

A prefill is any scheduled chunk of a request with more than one token left to compute
(a prompt, or a preempted request's recompute). With the limits on, a step runs at most
max_num_partial_prefills of them, each capped at an equal share of the token budget, and
at most max_long_partial_prefills whose remaining tokens exceed the long threshold. A
long prompt waiting while the long slots are taken is passed over, so short prompts
behind it start now instead of after it: one long prompt no longer holds back the first
tokens of every short one. Without limits (0, the default) nothing changes.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config import SchedulerConfig

# vLLM V0's long threshold when long_prefill_token_threshold is not given: 4% of
# max_model_len.
DEFAULT_LONG_SHARE = 0.04
# Waiting requests looked at past max_num_seqs for short ones to start while long ones
# wait: bounds the scan of a long queue each step.
LOOKAHEAD = 64


@dataclass(slots=True)
class PartialPrefills:
    max_prefills: int
    max_long: int
    long_threshold: int
    chunk_cap: int  # tokens one prefill may take this step
    num_prefills: int = 0
    num_long: int = 0

    @classmethod
    def for_step(cls, config: SchedulerConfig) -> "PartialPrefills | None":
        """A fresh per-step count, or None when no limit is set."""
        if not config.max_num_partial_prefills:
            return None
        threshold = config.long_prefill_token_threshold or max(
            1, int(DEFAULT_LONG_SHARE * config.max_model_len))
        limit = config.max_num_partial_prefills
        return cls(limit, config.max_long_partial_prefills or limit, threshold,
                   max(1, config.max_num_batched_tokens // limit))

    def full(self) -> bool:
        return self.num_prefills >= self.max_prefills

    def admits(self, remaining: int) -> bool:
        """Whether a prefill with `remaining` tokens left may run this step."""
        if self.full():
            return False
        return remaining <= self.long_threshold or self.num_long < self.max_long

    def take(self, remaining: int) -> None:
        self.num_prefills += 1
        if remaining > self.long_threshold:
            self.num_long += 1
