"""The rows a drafting request samples in one step (speculative decoding).

A request that proposed k tokens d_1..d_k has k + 1 rows: row j scores the position after
d_1..d_j, so everything that depends on the output so far (penalties, min_tokens, the
grammar's mask) must see d_1..d_j as output there: sampling row j then is exactly the
step that would have run had d_1..d_j been accepted one at a time (engine/sample/
rejection.py keeps the agreeing prefix). DraftPosition stands for the request at row j
wherever SamplingMetadata reads a Request."""
from __future__ import annotations

from engine.core.request import Request


class DraftPosition:
    __slots__ = ("request", "prefix")

    def __init__(self, request: Request, prefix: list[int]) -> None:
        self.request = request
        self.prefix = prefix  # d_1..d_j, j >= 1

    @property
    def request_id(self) -> str:
        return self.request.request_id  # a seeded row draws from the request's generator

    @property
    def sampling_params(self):
        return self.request.sampling_params

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.request.stop_token_ids

    @property
    def grammar(self):
        return self.request.grammar

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.prefix)


def expand_rows(requests: list[Request], drafts: dict[str, list[int]]) -> list:
    """Sampler rows in order: one per request, k + 1 for a request that proposed k."""
    if not drafts:
        return requests
    rows: list = []
    for request in requests:
        rows.append(request)
        proposed = drafts.get(request.request_id)
        if proposed:
            rows.extend(DraftPosition(request, proposed[:j])
                        for j in range(1, len(proposed) + 1))
    return rows
