"""Suffix decoding: proposals on hand-made token lists, the incremental trees against a
brute-force count of every substring, and the cross-request cache's scopes."""
from __future__ import annotations

import random

import pytest

from engine.config.speculative import SpeculativeConfig
from engine.core.request import Request, RequestStatus
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.spec_decode.proposer import make_proposer
from engine.spec_decode.suffix import SuffixProposer, _Node, _extend, _remove


def _config(**overrides) -> SpeculativeConfig:
    values = dict(method="suffix", num_speculative_tokens=8, suffix_decoding_max_tree_depth=16,
                  suffix_decoding_min_token_prob=0.1)
    values.update(overrides)
    return SpeculativeConfig(**values)


def _request(request_id: str, prompt: list[int], output: list[int] = (), tenant=None,
             lora_id=None) -> Request:
    lora = None if lora_id is None else LoRARequest(f"a{lora_id}", lora_id, "/x")
    request = Request(request_id, prompt, SamplingParams(max_tokens=1000), tenant=tenant,
                      lora_request=lora)
    request.all_token_ids.extend(output)
    return request


def _finish(proposer, request, status=RequestStatus.FINISHED_STOPPED) -> None:
    request.status = status
    proposer.finished([request])


def _propose(proposer, request, limit=100) -> list[int]:
    return proposer.propose([request], [limit])[0]


# -- proposals on hand-made lists ---------------------------------------------------------

def test_make_proposer_builds_it():
    assert isinstance(make_proposer(_config()), SuffixProposer)


def test_repeated_phrase_gets_its_continuation():
    proposer = SuffixProposer(_config())
    # 1 2 3 4 5 6 ... then 1 2 3 again: 4 5 6 7 follows.
    request = _request("r", [9, 1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3])
    assert _propose(proposer, request) == [4, 5, 6]  # max_spec_factor 1: 3 matched, 3 drafted
    request.all_token_ids.append(4)
    assert _propose(proposer, request) == [5, 6, 7, 8]


def test_no_match_proposes_nothing():
    proposer = SuffixProposer(_config())
    assert _propose(proposer, _request("r", [1, 2, 3, 4, 5])) == []
    assert _propose(proposer, _request("s", [7])) == []


def test_limits_and_num_speculative_tokens_cap_the_draft():
    text = list(range(10, 30))
    proposer = SuffixProposer(_config(suffix_decoding_max_spec_factor=4.0,
                                      num_speculative_tokens=5))
    request = _request("r", text + text[:6])
    assert _propose(proposer, request) == text[6:11]
    assert _propose(proposer, request, limit=2) == text[6:8]


def test_max_spec_factor_limits_by_match_length():
    text = list(range(10, 30))
    prompt = text + [99] + text[:2]  # 2 tokens matched
    assert _propose(SuffixProposer(_config(suffix_decoding_max_spec_factor=1.0)),
                    _request("r", prompt)) == text[2:4]
    assert _propose(SuffixProposer(_config(suffix_decoding_max_spec_factor=2.5)),
                    _request("r", prompt)) == text[2:7]
    assert _propose(SuffixProposer(_config(suffix_decoding_max_spec_factor=0.0)),
                    _request("r", prompt)) == []


def test_tree_depth_bounds_match_plus_draft():
    text = list(range(10, 40))
    proposer = SuffixProposer(_config(suffix_decoding_max_tree_depth=6,
                                      num_speculative_tokens=20,
                                      suffix_decoding_max_spec_factor=10.0))
    # Any match m leaves 6 - m tokens: m=1 gives the most (5), and wins on score.
    assert _propose(proposer, _request("r", text + text[:10])) == text[10:15]


def test_min_token_prob_cuts_where_continuations_disagree():
    # After 1 2 3 came 4 twice and 5 twice: each branch is 2/5 (the trailing 1 2 3 counts).
    prompt = [1, 2, 3, 4, 8, 1, 2, 3, 5, 9, 1, 2, 3, 4, 10, 1, 2, 3, 5, 11, 20, 1, 2, 3]
    high = SuffixProposer(_config(suffix_decoding_min_token_prob=0.5))
    assert _propose(high, _request("r", prompt)) == []
    low = SuffixProposer(_config(suffix_decoding_min_token_prob=0.3))
    # 4 got to two first; after it 8 and 10 disagree: 2/5 * 1/2 < 0.3.
    assert _propose(low, _request("r", prompt)) == [4]
    # 4 after every earlier 1 2 3: 4/5; the branches after it cut.
    agree = [1, 2, 3, 4, 9, 1, 2, 3, 4, 10, 1, 2, 3, 4, 11, 1, 2, 3, 4, 12, 13, 1, 2, 3]
    assert _propose(high, _request("s", agree)) == [4]


# -- incremental against brute force ------------------------------------------------------

def _reference(seq, depth, k, limit, factor, min_prob):
    """Arctic's speculate() spelled out over the list itself."""
    n = len(seq)

    def starts(sub):
        return [i for i in range(n - len(sub) + 1) if seq[i:i + len(sub)] == sub]

    best, best_score = [], 0.0
    for m in range(1, min(n, depth - 1) + 1):
        pattern = seq[n - m:]
        if len(starts(pattern)) < 2:
            break
        budget = min(limit, k, int(factor * m + 1e-6), depth - m)
        draft, prob, score, cur = [], 1.0, 0.0, pattern
        while len(draft) < budget:
            counts, reached = {}, {}
            for i in starts(cur):
                if i + len(cur) < n:
                    token = seq[i + len(cur)]
                    counts[token] = counts.get(token, 0) + 1
                    reached[token, counts[token]] = i
            if not counts:
                break
            top = max(counts.values())
            token = min((t for t in counts if counts[t] == top), key=lambda t: reached[t, top])
            prob *= top / len(starts(cur))
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            cur = cur + [token]
        if score >= best_score:
            best, best_score = draft, score
    return best


def _tree_counts(root, depth):
    counts = {}

    def walk(node, prefix):
        for token, child in node.children.items():
            key = prefix + (token,)
            if type(child) is _Node:
                assert child.count >= 1
                counts[key] = child.count
                walk(child, key)
            else:
                seq, pos = child
                for end in range(pos + 1, min(len(seq), pos + depth - len(prefix)) + 1):
                    counts[prefix + tuple(seq[pos:end])] = 1

    walk(root, ())
    return counts


def _brute_counts(seqs, depth):
    counts = {}
    for seq in seqs:
        for i in range(len(seq)):
            for end in range(i + 1, min(len(seq), i + depth) + 1):
                key = tuple(seq[i:end])
                counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("seed", range(6))
def test_incremental_matches_brute_force(seed):
    rng = random.Random(seed)
    depth = rng.choice([3, 5, 8])
    config = _config(suffix_decoding_max_tree_depth=depth, num_speculative_tokens=6,
                     suffix_decoding_max_spec_factor=rng.choice([0.5, 1.0, 2.0]),
                     suffix_decoding_min_token_prob=rng.choice([0.0, 0.2, 0.4]))
    proposer = SuffixProposer(config)
    vocab = rng.choice([2, 3, 5])
    request = _request("r", [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))])
    for _ in range(60):
        limit = rng.randrange(1, 8)
        got = _propose(proposer, request, limit)
        seq = request.all_token_ids
        assert got == _reference(seq, depth, 6, limit, config.suffix_decoding_max_spec_factor,
                                 config.suffix_decoding_min_token_prob), seq
        assert _tree_counts(proposer._locals["r"].active[0], depth) == _brute_counts([seq], depth)
        # A step accepts 1 to 3 tokens; sometimes they copy the draft.
        new = got[:rng.randrange(0, 3)] + [rng.randrange(vocab)]
        request.all_token_ids.extend(new)


@pytest.mark.parametrize("seed", range(4))
def test_cache_eviction_leaves_what_a_fresh_tree_has(seed):
    rng = random.Random(seed)
    depth, root, kept = 5, _Node(0), []
    for _ in range(30):
        seq = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 12)))
        active = [root]
        for n in range(len(seq)):
            active = _extend(active, seq, n, depth)
        kept.append(seq)
        if len(kept) > 4:
            _remove(root, kept.pop(0), depth)
        assert _tree_counts(root, depth) == _brute_counts(kept, depth)
    for seq in kept:
        _remove(root, seq, depth)
    assert root.children == {} and root.count == 0


# -- the cross-request cache --------------------------------------------------------------

TEXT = [50 + i for i in range(20)]


def _cached_proposer(n=2) -> SuffixProposer:
    return SuffixProposer(_config(suffix_decoding_max_cached_requests=n))


def test_finished_output_is_proposed_to_the_same_scope():
    proposer = _cached_proposer()
    first = _request("a1", [1, 2], TEXT, tenant="A")
    assert _propose(proposer, first) == []
    _finish(proposer, first)
    assert _propose(proposer, _request("a2", [3, 4] + TEXT[:5], tenant="A")) == TEXT[5:10]
    assert _propose(proposer, _request("d", [3] + TEXT[:5])) == []  # tenant None: "default"


def test_other_tenants_and_adapters_never_see_it():
    proposer = _cached_proposer()
    _finish(proposer, _request("a1", [1], TEXT, tenant="A", lora_id=1))
    prompt = [3] + TEXT[:5]
    assert _propose(proposer, _request("b", prompt, tenant="B", lora_id=1)) == []
    assert _propose(proposer, _request("a-base", prompt, tenant="A")) == []
    assert _propose(proposer, _request("a-lora2", prompt, tenant="A", lora_id=2)) == []
    assert _propose(proposer, _request("a-lora1", prompt, tenant="A", lora_id=1)) == TEXT[5:10]


def test_nothing_is_kept_when_the_cache_is_off():
    proposer = SuffixProposer(_config())
    first = _request("a1", [1], TEXT, tenant="A")
    assert _propose(proposer, first) == []
    _finish(proposer, first)
    assert proposer._locals == {} and proposer._scopes == {}
    assert _propose(proposer, _request("a2", [3] + TEXT[:5], tenant="A")) == []


def test_aborted_requests_are_not_cached():
    proposer = _cached_proposer()
    _finish(proposer, _request("a1", [1], TEXT, tenant="A"), RequestStatus.FINISHED_ABORTED)
    assert _propose(proposer, _request("a2", [3] + TEXT[:5], tenant="A")) == []
    _finish(proposer, _request("a3", [1], TEXT), RequestStatus.FINISHED_LENGTH_CAPPED)
    assert _propose(proposer, _request("a4", [3] + TEXT[:5])) == TEXT[5:10]


def test_prompts_are_not_cached():
    proposer = _cached_proposer()
    _finish(proposer, _request("a1", TEXT, [7]))
    assert _propose(proposer, _request("a2", [3] + TEXT[:5])) == []


def test_fifo_eviction_keeps_at_most_the_bound():
    proposer = _cached_proposer(n=2)
    texts = [[100 * k + i for i in range(10)] for k in range(1, 5)]
    for k, text in enumerate(texts):
        _finish(proposer, _request(f"a{k}", [1], text))
    scope = proposer._scopes["default", None]
    assert list(scope.outputs) == [tuple(texts[2]), tuple(texts[3])]
    assert _tree_counts(scope.root, 16) == _brute_counts(scope.outputs, 16)
    for k, text in enumerate(texts):
        got = _propose(proposer, _request(f"q{k}", [2] + text[:3]))
        assert got == (text[3:6] if k >= 2 else [])


def test_own_text_wins_a_tie_and_a_better_cached_path_wins():
    proposer = _cached_proposer()
    _finish(proposer, _request("a1", [1], [5, 6, 7, 8, 9]))
    # Own text: 5 6 -> 70 71 (prob 1/2 each: the trailing 5 6 counts). Cache: 5 6 -> 7 8
    # with prob 1: the cache scores higher.
    assert _propose(proposer, _request("a2", [5, 6, 70, 71, 5, 6])) == [7, 8]
    # Own text: 4 5 6 -> 70 71 72 at 2/3 each (score 2); the cache's 5 6 -> 7 8 scores
    # 2 as well: the request's own text keeps the tie.
    own = [1, 4, 5, 6, 70, 71, 72, 2, 4, 5, 6, 70, 71, 72, 3, 4, 5, 6]
    assert _propose(proposer, _request("a3", own)) == [70, 71, 72]


def test_finished_drops_request_state():
    proposer = _cached_proposer()
    requests = [_request(f"r{i}", [1, 2, 1, 2], [1]) for i in range(5)]
    proposer.propose(requests, [4] * 5)
    assert len(proposer._locals) == 5
    for status, request in zip([RequestStatus.FINISHED_ABORTED] * 2 +
                               [RequestStatus.FINISHED_STOPPED] * 3, requests):
        _finish(proposer, request, status)
    assert proposer._locals == {}
    assert len(proposer._scopes["default", None].outputs) == 2


def test_reused_request_id_starts_over():
    proposer = SuffixProposer(_config())
    assert _propose(proposer, _request("r", [1, 2, 3, 1, 2])) == [3, 1]
    assert _propose(proposer, _request("r", [7, 8, 9, 7])) == [8]
