"""Between steps: who proposes, how many tokens, and what happens to drafts the grammar or
the limits rule out. The engine calls it; the scheduler and the runner see only
Request.spec_token_ids."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from engine.core.request import Request, RequestStatus
from engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from engine.config.speculative import SpeculativeConfig


class Speculator:
    def __init__(self, config: "SpeculativeConfig", proposer: Proposer,
                 max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len

    def propose(self, updated: Iterable[Request], num_running: int) -> None:
        """Drafts for the requests a step just gave tokens, still running. None when more
        than disable_by_batch_size requests run: verification costs compute that a big
        batch does not have to spare."""
        cutoff = self.config.disable_by_batch_size
        if cutoff is not None and num_running > cutoff:
            return
        k = self.config.num_speculative_tokens
        requests: list[Request] = []
        limits: list[int] = []
        for request in updated:
            if request.status != RequestStatus.RUNNING:
                continue
            # Positions past max_model_len cannot be computed; tokens past max_tokens are
            # never kept (a step yields its accepted drafts and one more).
            limit = min(k, self.max_model_len - request.num_tokens)
            if request.max_tokens is not None:
                limit = min(limit, request.max_tokens - request.num_output_tokens - 1)
            if limit > 0:
                requests.append(request)
                limits.append(limit)
        if not requests:
            return
        take_probs = getattr(self.proposer, "take_probs", None)
        for request, drafts in zip(requests, self.proposer.propose(requests, limits)):
            if drafts and request.grammar is not None:
                # A token the grammar refuses can never be sampled there: cut it and the rest.
                drafts = drafts[:request.grammar.accepted_prefix(drafts)]
            request.spec_token_ids = list(drafts)
            # The runner reads as many rows as drafts get scheduled.
            request.spec_token_probs = None if take_probs is None else take_probs(request)

    def finished(self, requests: Iterable[Request]) -> None:
        done = [r for r in requests if r.is_finished]
        if done:
            self.proposer.finished(done)
