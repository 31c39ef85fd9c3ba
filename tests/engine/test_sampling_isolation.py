"""One request's sampling parameters never hurt the rest of its batch: every value either
fails validation with a ValueError naming the field, or the request completes; a value
that slips past validation and still breaks sampling fails that request only."""
from __future__ import annotations

import itertools
import json
import math
import re

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from backend.request_parsing import load_json_object, parse_sampling_parameters
from engine import LLM, SamplingParams
from engine.llm_engine import EngineStepError
from testing.tiny_model import make_tiny_model_dir

pytestmark = pytest.mark.timeout(600)

VOCAB = 1024  # small, so the sampler's whole-vocabulary passes keep the fuzzing fast
MAX_MODEL_LEN = 32
# Token-id prompts: the SmolLM2 tokenizer would produce ids beyond VOCAB.
# by-2 is still in chunked prefill (even after a prefix-cache hit) when the others sample.
BYSTANDERS = {"by-0": [5, 17, 300, 4, 9], "by-1": [700, 701, 702], "by-2": list(range(40, 63))}
BYSTANDER_PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [11, 12, 13]
_tags = itertools.count()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-1k"), seed=5, vocab_size=VOCAB)
    return LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=8,
               max_model_len=MAX_MODEL_LEN, long_prefill_token_threshold=3)


@pytest.fixture(scope="module")
def expected(llm):
    """Each bystander's greedy output when it runs alone."""
    return {rid: llm.generate([ids], BYSTANDER_PARAMS, use_tqdm=False)[0].outputs[0].token_ids
            for rid, ids in BYSTANDERS.items()}


def run_with_bystanders(engine, params=None):
    """Adds the bystanders, then a request with `params` (if given), and steps until all
    are done. Returns (the ValueError that rejected the request, its final output, the
    bystanders' outputs, the step errors seen)."""
    tag = next(_tags)
    for rid, ids in BYSTANDERS.items():
        engine.add_request(f"{rid}-{tag}", ids, BYSTANDER_PARAMS)
    request_id, rejected = f"x-{tag}", None
    if params is not None:
        try:
            engine.add_request(request_id, PROMPT, params)
        except ValueError as exc:
            rejected = exc
    finals, errors = {}, []
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except EngineStepError as exc:
            errors.append(exc)
            continue
        finals.update((o.request_id, o) for o in outputs if o.finished)
    bystanders = {rid: finals[f"{rid}-{tag}"].outputs[0].token_ids if f"{rid}-{tag}" in finals
                  else None for rid in BYSTANDERS}
    failed = [[r.removesuffix(f"-{tag}") for r in e.failed_request_ids] for e in errors]
    return rejected, finals.get(request_id), bystanders, failed


# ---- values thrown at every field -------------------------------------------------
NASTY = st.sampled_from([
    None, True, False, "", "abc", "nan", "NaN", "inf", "-inf", "Infinity", "1e999", "-1", "0",
    "1", "0.5", "1e-46", " 7 ", "null", float("nan"), float("inf"), float("-inf"), 0, -1, 1, 2,
    0.0, -0.0, 1.0, 0.5, 5e-324, 1e-46, 1e-38, 1e-5, 1e300, -1e300, 2**31, 2**63 - 1, 2**63,
    2**64 - 1, 2**64, -2**63, -2**63 - 1, 10**30, 10**400, [], [1], [[1]], {}, {"a": 1},
    "[1, 2]", '["x"]', "[", '{"a": 1}'])
HUGE_INTS = st.integers(min_value=-2**70, max_value=2**70) | st.sampled_from([10**30, 10**400])
ODD_FLOATS = st.floats(allow_nan=True, allow_infinity=True) | HUGE_INTS

# In range, with the edges of the range (float32 underflow and overflow included).
VALID = {
    "max_tokens": st.integers(1, 40) | st.sampled_from([10**30, None]),
    "temperature": st.floats(0, 3) | st.sampled_from([1e300, 1e-300, 1e-6, 2e-5, 0]),
    "top_k": st.integers(-1, 60) | st.sampled_from([VOCAB - 1, VOCAB, VOCAB + 1, 2**70]),
    "top_p": st.floats(0, 1, exclude_min=True) | st.sampled_from([1e-46, 5e-324, 1 - 1e-9, 1]),
    "min_p": st.floats(0, 1) | st.sampled_from([1e-46, 5e-324, 1]),
    "seed": st.integers(-2**63, 2**64 - 1) | st.sampled_from([-1, 0, 2**64 - 1, -2**63]),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3) | st.text(min_size=1, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "ignore_eos": st.booleans() | st.sampled_from(["true", "false", "yes", 0, 1]),
    "min_tokens": st.integers(0, 8),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "logprobs": st.none() | st.integers(0, 20),
    "repetition_penalty": st.floats(0, 3, exclude_min=True) | st.sampled_from(
        [1e-300, 1e300, 1e-46, 5e-324]),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "n": st.sampled_from([1, "1", 1.0]),
    "best_of": st.just(1),
    "use_beam_search": st.sampled_from([False, "false"]),
}
# Out of range, of the wrong type, or not a field at all.
INVALID = {
    **{name: ODD_FLOATS for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                                     "presence_penalty", "frequency_penalty")},
    **{name: HUGE_INTS | st.floats() for name in ("max_tokens", "top_k", "seed", "min_tokens",
                                                  "logprobs")},
    "stop": st.lists(st.text(max_size=2) | st.integers(), max_size=3) | st.integers(),
    "stop_token_ids": st.lists(st.integers(-2, VOCAB + 2) | HUGE_INTS | st.text(), max_size=4),
    "ignore_eos": st.sampled_from([2, "maybe", 0.5]),
    "n": st.sampled_from([2, "2"]),
    "best_of": st.just(2),
    "use_beam_search": st.just(True),
    "not_a_field": st.integers(),
}


def as_sent(strategy):
    # As a client sends it: typed JSON or its string form.
    return strategy | strategy.map(str)


# Mostly-valid objects reach the sampler; the others exercise every rejection.
SAMPLING_OBJECTS = (
    st.fixed_dictionaries({}, optional={k: as_sent(v) for k, v in VALID.items()})
    | st.fixed_dictionaries({}, optional={
        k: as_sent(VALID.get(k, st.nothing()) | INVALID.get(k, st.nothing())) | NASTY
        for k in VALID.keys() | INVALID.keys()}))


def names_a_given_field(message: str, fields) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message)
               or f"SamplingParams.{name}" in message for name in fields)


@settings(max_examples=50, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sampling=SAMPLING_OBJECTS)
def test_any_sampling_object_is_rejected_by_name_or_completes_beside_others(
        llm, expected, sampling):
    engine = llm.llm_engine
    try:
        # The backend's path: JSON text (NaN and Infinity are legal there) -> SamplingParams.
        params = parse_sampling_parameters(
            load_json_object("sampling_parameters", json.dumps(sampling)))
    except ValueError as exc:
        event("rejected while parsing")
        assert names_a_given_field(str(exc), sampling), (sampling, str(exc))
        return
    rejected, final, bystanders, failed = run_with_bystanders(engine, params)
    event("rejected by the engine" if rejected is not None else "ran")
    assert not failed and bystanders == expected
    assert engine.get_stats().kv_cache_usage == 0.0
    if rejected is not None:  # the engine's own checks (logprobs, stop_token_ids vs vocab)
        assert names_a_given_field(str(rejected), sampling), (sampling, str(rejected))
        return
    out = final.outputs[0]
    assert out.finish_reason in ("stop", "length"), sampling
    assert all(0 <= t < VOCAB for t in out.token_ids)
    assert 1 <= len(out.token_ids) <= MAX_MODEL_LEN - len(PROMPT)
    if params.max_tokens is not None:
        assert len(out.token_ids) <= params.max_tokens
    if params.logprobs is not None:
        assert len(out.logprobs) == len(out.token_ids)
        assert all(math.isfinite(lp[t].logprob) for t, lp in zip(out.token_ids, out.logprobs))


@pytest.mark.parametrize("sampling", [
    {"top_p": 1e-46},
    {"seed": 18446744073709551616},
    {"temperature": float("inf"), "min_tokens": 4, "top_p": 0.9},
    {"temperature": "Infinity"},
    {"repetition_penalty": float("nan")},
    {"presence_penalty": "-inf"},
    {"temperature": 10**400},
])
def test_the_issue_examples_are_rejected_by_name_or_complete(llm, expected, sampling):
    try:
        params = parse_sampling_parameters(
            load_json_object("sampling_parameters", json.dumps(sampling)))
    except ValueError as exc:
        assert names_a_given_field(str(exc), sampling), str(exc)
        return
    rejected, final, bystanders, failed = run_with_bystanders(llm.llm_engine, params)
    assert rejected is None and not failed and bystanders == expected and final.finished


def test_a_number_past_the_json_digit_limit_is_a_client_error():
    with pytest.raises(ValueError, match="sampling_parameters"):
        load_json_object("sampling_parameters", '{"seed": ' + "9" * 5000 + "}")


def corrupted(**changes):
    """Params that passed validation, then changed: a stand-in for a value validation
    misses and sampling cannot handle."""
    params = SamplingParams(temperature=1.0, max_tokens=8)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("changes", [
    {"seed": 2**70},  # fails while the batch's sampling tensors are built
    {"top_k": 0.5},   # fails inside the sampler: a k of 0 gathers index -1
], ids=["prepare", "sample"])
def test_a_request_that_breaks_sampling_fails_alone_and_the_batch_carries_on(
        llm, expected, changes):
    engine = llm.llm_engine
    rejected, final, bystanders, failed = run_with_bystanders(engine, corrupted(**changes))
    assert rejected is None and final is None
    assert failed == [["x"]]
    # Including by-2, which was mid-prefill in the failed step, and the others, which
    # resampled the token that step lost.
    assert bystanders == expected
    assert engine.get_stats().kv_cache_usage == 0.0
    # The prefix cache was not reset: the bystanders' prompt blocks still hit.
    hits = engine.get_stats().prefix_cache_hits
    _, _, again, failed = run_with_bystanders(engine)
    assert not failed and again == expected
    assert engine.get_stats().prefix_cache_hits > hits
