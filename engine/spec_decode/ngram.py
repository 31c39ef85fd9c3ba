"""Prompt lookup (vLLM's ngram method): the tokens that followed an earlier occurrence of
the request's last n tokens are proposed as its next ones.

vLLM's choice of occurrence: the longest n in [prompt_lookup_min, prompt_lookup_max]
that occurs earlier, and of its occurrences the earliest. vLLM scans the whole sequence
each step (KMP over the reversed tokens); here each request keeps an index of its
n-grams, extended by the tokens appended since the last call, so a step costs a few
dictionary look-ups per request however long it is."""
from __future__ import annotations

from typing import Sequence

from engine.core.request import Request


class _NgramIndex:
    __slots__ = ("first_end", "indexed")

    def __init__(self) -> None:
        # n-gram (as a tuple) -> the index just past its earliest occurrence.
        self.first_end: dict[tuple[int, ...], int] = {}
        # n-grams ending before this index are in first_end.
        self.indexed = 0


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        return [self._propose_one(request, limit) for request, limit in zip(requests, limits)]

    def _propose_one(self, request: Request, limit: int) -> list[int]:
        tokens = request.all_token_ids
        num_tokens = len(tokens)
        if num_tokens <= self.min_n:
            return []
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = _NgramIndex()
        first_end = index.first_end
        min_n, max_n = self.min_n, self.max_n
        # An n-gram ending at the last token is the suffix itself: only those ending
        # earlier are indexed, so a hit has at least one token after it.
        for end in range(index.indexed + 1, num_tokens):
            for n in range(min_n, min(max_n, end) + 1):
                first_end.setdefault(tuple(tokens[end - n:end]), end)
        index.indexed = num_tokens - 1
        for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
            start = first_end.get(tuple(tokens[num_tokens - n:]))
            if start is not None:
                return tokens[start:start + limit]
        return []

    def finished(self, requests: Sequence[Request]) -> None:
        for request in requests:
            self._indexes.pop(request.request_id, None)
