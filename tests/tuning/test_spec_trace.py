"""Speculative decoding in the workload trace (engine/metrics/trace.py) and its replay
(tuning/spec_replay.py): the trace carries the drafts and what they kept, per step and per
request, with the engine's own totals; the replay drafts and accepts as recorded, so it
takes about the recorded number of steps, and a trace without drafts replays as before.

Random weights do not copy text, so the drafts come from an oracle that knows the plain
run's outputs and spoils every third draft at one position (as tests/engine/spec_decode/
test_spec_generate.py does): both acceptances and rejections are in every run."""
from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.config.speculative import SpeculativeConfig
from engine.metrics.trace import speculative_args
from testing.spec_oracle import Oracle
from testing.tiny_model import make_tiny_model_dir
from tuning.replay import measured, replay
from tuning.spec_replay import draft_rate, num_speculative_tokens
from tuning.step_model import FEATURES, StepModel, fit, step_durations
from tuning.tables import comparison_table
from tuning.trace_file import Trace, read_trace

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived a",
           "1, 2, 3, 4,", "Paris is the capital of", "def main():\n    print(", "A" * 3,
           "Tell me a story about", "Seven eight nine"]
MAX_TOKENS = [30, 24, 40, 12, 36, 20, 28, 16]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
ARGS = {"dtype": "float32", "num_kv_blocks": 256, "block_size": 8, "max_model_len": 256,
        "max_num_seqs": 4}
CONSTANT = StepModel(0.001, {name: 0.0 for name in FEATURES}, 0.001)


def params():
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A run with drafts for all prompts but the last, its trace and the engine's stats."""
    folder = tmp_path_factory.mktemp("spec_trace")
    tiny = str(make_tiny_model_dir(folder / "llama", arch="llama", seed=3))
    plain_llm = LLM(tiny, **ARGS)
    try:
        plain = plain_llm.generate(PROMPTS, params(), use_tqdm=False)
    finally:
        plain_llm.llm_engine.close()
    path = folder / "trace.jsonl"
    llm = LLM(tiny, **ARGS, speculative_config=NGRAM, trace_path=str(path))
    try:
        tok = llm.get_tokenizer()
        expected = {tuple(tok.encode(p)): o.outputs[0].token_ids
                    for p, o in zip(PROMPTS[:-1], plain)}
        llm.llm_engine.speculator.proposer = Oracle(expected, llm.llm_engine.loaded.vocab_size)
        outs = llm.generate(PROMPTS, params(), use_tqdm=False)
        stats = llm.llm_engine.get_stats().spec_decoding
    finally:
        llm.llm_engine.close()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    return read_trace(path), stats


def test_the_trace_carries_the_drafts_with_the_engines_totals(recorded):
    trace, stats = recorded
    config = trace.engine_args["speculative_config"]
    assert config["method"] == "ngram" and config["num_speculative_tokens"] == 4
    assert num_speculative_tokens(trace) == 4
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    for records in (trace.steps, trace.requests):
        assert all({"num_drafts", "draft_tokens", "accepted_tokens"} <= set(r) for r in records)
        assert sum(r["num_drafts"] for r in records) == stats.num_drafts
        assert sum(r["draft_tokens"] for r in records) == stats.num_draft_tokens
        assert sum(r["accepted_tokens"] for r in records) == stats.num_accepted_tokens
    for step in trace.steps:
        assert step["accepted_tokens"] <= step["draft_tokens"] <= 4 * step["num_drafts"]
        # a drafting decode's positions are decode tokens: one each plus its drafts
        assert step["decode_tokens"] >= step["draft_tokens"] + step["num_drafts"]
        assert step["num_prefills"] + step["num_drafts"] <= step["batch_size"]
    by_id = {r["id"]: r for r in trace.requests}
    assert len(by_id) == len(PROMPTS)
    last = [r for r in trace.requests if r["output_len"] == MAX_TOKENS[-1]]
    assert last and last[0]["num_drafts"] == 0  # the oracle does not know its prompt
    for record, n in zip(sorted(trace.requests, key=lambda r: int(r["id"])), MAX_TOKENS):
        assert record["output_len"] == n
        # every token is the first, an accepted draft token, or one of a decode step
        assert record["accepted_tokens"] <= n - 1 - record["num_drafts"]


def test_the_replay_drafts_and_accepts_as_recorded(recorded):
    trace, _ = recorded
    model = fit(step_durations(trace))
    predicted, actual = replay(trace, model), measured(trace)
    assert predicted.requests == actual.requests
    assert sum(r.output_len for r in predicted.extra["per_request"].values()) == sum(MAX_TOKENS)
    assert predicted.steps == pytest.approx(actual.steps, rel=0.15)
    spec, recorded_spec = predicted.extra["speculative"], actual.extra["speculative"]
    assert spec["draft_tokens"] == pytest.approx(recorded_spec["draft_tokens"], rel=0.2)
    assert spec["accepted_tokens"] == pytest.approx(recorded_spec["accepted_tokens"], rel=0.25)
    assert "accepted / drafted" in comparison_table(actual, predicted)
    # deterministic for a seed; without drafts, a step per token: many more steps
    assert replay(trace, model).steps == predicted.steps
    plain = replay(trace, model, {"num_speculative_tokens": 0})
    assert "speculative" not in plain.extra
    assert plain.steps > predicted.steps * 1.3


def strip_speculation(trace: Trace) -> Trace:
    names = {"num_drafts", "draft_tokens", "accepted_tokens"}
    args = {k: v for k, v in trace.engine_args.items() if k != "speculative_config"}
    return Trace({**trace.header, "engine_args": args},
                 [{k: v for k, v in r.items() if k not in names} for r in trace.requests],
                 [{k: v for k, v in s.items() if k not in names} for s in trace.steps])


def test_a_trace_without_the_fields_replays_without_drafts(recorded):
    """A version-1 trace (no speculative fields) replays as before: no drafts, exactly the
    replay with speculation turned off."""
    trace, _ = recorded
    old = strip_speculation(trace)
    assert num_speculative_tokens(old) == 0
    assert all(draft_rate(r) is None for r in old.requests)
    a, b = replay(old, CONSTANT), replay(trace, CONSTANT, {"num_speculative_tokens": 0})
    assert "speculative" not in a.extra and a.steps == b.steps
    assert a.extra["sim_seconds"] == b.extra["sim_seconds"]


def test_draft_rate_from_a_request_record():
    # 20 tokens: the first, 9 accepted, 10 decode steps; a length finish leaves 9 chances
    rate = draft_rate({"output_len": 20, "finish_reason": "length", "num_drafts": 6,
                       "draft_tokens": 18, "accepted_tokens": 9})
    assert rate.probability == pytest.approx(6 / 9) and rate.mean_length == 3
    assert rate.acceptance == pytest.approx(0.5)
    assert draft_rate({"output_len": 5, "finish_reason": "stop", "num_drafts": 0,
                       "draft_tokens": 0, "accepted_tokens": 0}) is None


def test_the_speculative_config_serialises():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    args = speculative_args(config)
    assert args == dataclasses.asdict(config) and args["prompt_lookup_min"] == 5
    assert SpeculativeConfig(**args) == config  # the header's keys load back as given
    assert speculative_args(None) is None
