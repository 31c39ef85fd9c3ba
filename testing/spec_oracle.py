"""A fake proposer for speculative decoding's tests: random-weight models do not copy
text, so drafts come from an oracle that knows the plain run's outputs and spoils some of
them on purpose (runs then have both accepted and rejected drafts)."""
from __future__ import annotations


class Oracle:
    """Proposes the plain run's next tokens for the prompts it knows (by prompt token
    ids); every third draft has its token at position (calls % length) made wrong.
    Proposes nothing for prompts it does not know (plain requests in a drafting batch)."""

    def __init__(self, expected: dict[tuple, list[int]], vocab_size: int) -> None:
        self.expected = expected
        self.vocab_size = vocab_size
        self.calls = 0

    def propose(self, requests, limits):
        out = []
        for request, limit in zip(requests, limits):
            truth = self.expected.get(tuple(request.prompt_token_ids))
            if truth is None:
                out.append([])
                continue
            done = request.num_output_tokens
            drafts = list(truth[done:done + limit])
            self.calls += 1
            if drafts and self.calls % 3 == 0:
                spoil = self.calls % len(drafts)
                drafts[spoil] = (drafts[spoil] + 1) % self.vocab_size
            out.append(drafts)
        return out

    def finished(self, requests):
        pass
