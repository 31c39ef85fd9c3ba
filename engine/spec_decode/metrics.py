"""Speculative decoding's counters, as vLLM exposes them (vllm:spec_decode_*)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    """Totals since start. A draft is one request's proposal verified in one step."""
    num_spec_tokens: int  # the configured num_speculative_tokens: positions counted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Index i: drafts whose token at position i was accepted (vLLM's per-position counter).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for position in range(min(num_accepted, len(per_pos))):
            per_pos[position] += 1

    def snapshot(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafting step yields per request on average: accepted + the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
