"""Prompt lookup (engine/spec_decode/ngram.py) against vLLM's rule written out plainly:
the longest n in [min, max] whose n-gram ends the tokens and occurs earlier, its earliest
occurrence, and the tokens after it (at most the limit)."""
import random

from engine.core.request import Request
from engine.spec_decode.ngram import NgramProposer


def reference(tokens, min_n, max_n, limit):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):  # occurrences other than the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + limit]
    return []


def test_a_repeated_phrase_proposes_its_continuation():
    request = Request("r", [1, 2, 3, 4, 5, 9, 9, 1, 2, 3])
    assert NgramProposer(2, 3).propose([request], [4]) == [[4, 5, 9, 9]]
    assert NgramProposer(2, 3).propose([request], [2]) == [[4, 5]]


def test_no_earlier_occurrence_proposes_nothing():
    request = Request("r", [1, 2, 3, 4, 5, 6])
    assert NgramProposer(1, 3).propose([request], [4]) == [[]]


def test_longest_then_earliest():
    # "7 8" occurs twice before the end; "6 7 8" once (the later one): longest wins.
    tokens = [7, 8, 1, 6, 7, 8, 2, 3, 6, 7, 8]
    assert NgramProposer(2, 3).propose([Request("r", tokens)], [2]) == [[2, 3]]
    # With n capped at 2 the earliest "7 8" is taken.
    assert NgramProposer(2, 2).propose([Request("r", tokens)], [2]) == [[1, 6]]


def test_incremental_index_matches_the_reference_as_tokens_are_appended():
    rng = random.Random(0)
    for case in range(60):
        min_n = rng.randint(1, 3)
        max_n = min_n + rng.randint(0, 3)
        proposer = NgramProposer(min_n, max_n)
        request = Request(f"r{case}", [rng.randint(0, 4) for _ in range(rng.randint(1, 12))])
        for _ in range(40):
            limit = rng.randint(1, 5)
            expected = reference(request.all_token_ids, min_n, max_n, limit)
            assert proposer.propose([request], [limit]) == [expected], (request.all_token_ids,
                                                                       min_n, max_n)
            request.all_token_ids.extend(rng.randint(0, 4) for _ in range(rng.randint(1, 3)))


def test_finished_requests_drop_their_index():
    proposer = NgramProposer(2, 2)
    request = Request("r", [1, 2, 1, 2])
    proposer.propose([request], [1])
    proposer.finished([request])
    assert not proposer._indexes
