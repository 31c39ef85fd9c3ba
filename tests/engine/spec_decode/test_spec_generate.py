"""Speculative decoding through LLM.generate on a tiny random model (float32): greedy
outputs with drafts equal outputs without, token for token, alone and in batches that mix
drafting and plain requests, under preemption, chunked prefill and prefix hits, with
stops, logprobs, penalties and structured outputs; in batch-invariant mode the logprobs
are bit-identical too.

Random weights do not copy text, so n-gram drafts are rarely right here: the drafts come
from an oracle that knows the plain run's outputs and spoils some of them on purpose
(every run below has both accepted and rejected drafts). The n-gram proposer itself
proposes on SmolLM2 in test_speculative_config.py, where copying is real."""
import pytest

from engine import LLM, SamplingParams
from testing.spec_oracle import Oracle
from testing.tiny_model import make_tiny_model_dir

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived a",
           "1, 2, 3, 4,", "Paris is the capital of", "def main():\n    print(", "A" * 3]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("llama"), arch="llama", seed=3))


def run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def with_oracle(llm, prompts, plain_outputs, drafting=None):
    ids = [tuple(llm.get_tokenizer().encode(p)) for p in prompts]
    drafting = range(len(prompts)) if drafting is None else drafting
    oracle = Oracle({ids[i]: plain_outputs[i].token_ids for i in drafting},
                    llm.llm_engine.loaded.vocab_size)
    llm.llm_engine.speculator.proposer = oracle
    return oracle


def draft_counts(llm):
    stats = llm.llm_engine.get_stats().spec_decoding
    return stats.num_accepted_tokens, stats.num_draft_tokens - stats.num_accepted_tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3,
                   repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
    SamplingParams(temperature=0, max_tokens=24, min_tokens=6, logprobs=0),
], ids=["greedy", "penalties-logprobs", "min-tokens"])
def test_greedy_outputs_equal_outputs_without_drafts(tiny, params):
    plain = run(LLM(tiny, dtype="float32", num_kv_blocks=256, block_size=16), PROMPTS, params)
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256, block_size=16,
              speculative_config=NGRAM)
    with_oracle(llm, PROMPTS, plain, drafting=range(0, len(PROMPTS), 2))
    drafted = run(llm, PROMPTS, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert [o.text for o in drafted] == [o.text for o in plain]
    accepted, rejected = draft_counts(llm)
    assert accepted > 0 and rejected > 0
    if params.logprobs is not None:
        for got, want in zip(drafted, plain):
            assert len(got.logprobs) == len(got.token_ids)
            for got_pos, want_pos in zip(got.logprobs, want.logprobs):
                assert got_pos.keys() == want_pos.keys()
                for token, entry in got_pos.items():
                    assert entry.logprob == pytest.approx(want_pos[token].logprob, abs=1e-4)
                    assert entry.rank == want_pos[token].rank


def test_stops_preemption_chunking_and_prefix_hits_keep_greedy_outputs(tiny):
    system = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [system + p for p in PROMPTS] + PROMPTS
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = run(LLM(tiny, dtype="float32", num_kv_blocks=512, enable_prefix_caching=False),
                prompts, params)
    # A stop id from the middle of each output: both runs must end there.
    stops = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[o.token_ids[9]])
             for o in plain]
    plain_stopped = run(LLM(tiny, dtype="float32", num_kv_blocks=512), prompts, stops)
    stressed = LLM(tiny, dtype="float32", block_size=4, num_kv_blocks=48, max_model_len=150,
                   max_num_batched_tokens=24, long_prefill_token_threshold=7, max_num_seqs=8,
                   speculative_config=NGRAM)
    with_oracle(stressed, prompts, plain)
    assert [o.token_ids for o in run(stressed, prompts, params)] == [o.token_ids for o in plain]
    stats = stressed.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    assert all(n > 0 for n in draft_counts(stressed))
    with_oracle(stressed, prompts, plain_stopped)
    got = run(stressed, prompts, stops)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain_stopped]
    assert all(o.finish_reason == "stop" for o in got)


def test_batch_invariant_logprobs_are_bit_identical(tiny):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    plain = run(LLM(tiny, batch_invariant=True, num_kv_blocks=256), PROMPTS, params)
    llm = LLM(tiny, batch_invariant=True, num_kv_blocks=256, speculative_config=NGRAM)
    with_oracle(llm, PROMPTS, plain, drafting=range(1, len(PROMPTS), 2))
    drafted = run(llm, PROMPTS, params)
    assert all(n > 0 for n in draft_counts(llm))
    for got, want in zip(drafted, plain):
        assert got.token_ids == want.token_ids
        assert [{t: (e.logprob, e.rank) for t, e in pos.items()} for pos in got.logprobs] == \
            [{t: (e.logprob, e.rank) for t, e in pos.items()} for pos in want.logprobs]


def test_structured_outputs_see_exactly_the_accepted_tokens(tiny):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
              "required": ["city", "zip"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": schema})
    plain = run(LLM(tiny, dtype="float32", num_kv_blocks=256), PROMPTS, params)
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256, speculative_config=NGRAM)
    oracle = with_oracle(llm, PROMPTS, plain)
    drafted = run(llm, PROMPTS, params)
    assert [o.text for o in drafted] == [o.text for o in plain]
    assert all(o.finish_reason == "stop" for o in drafted)
    assert oracle.calls > 0 and draft_counts(llm)[0] > 0


def test_stop_strings_and_parallel_samples_see_exactly_the_accepted_tokens(tiny):
    """A stop string from the middle of each plain output ends the drafted run at the same
    text, and n = 2 runs its two sequences' drafts apart."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = LLM(tiny, dtype="float32", num_kv_blocks=256)
    plain = run(base, PROMPTS, params)
    stops = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2,
                            stop=[o.text[len(o.text) // 2:len(o.text) // 2 + 3]]) for o in plain]
    want = [[c.text for c in o.outputs] for o in base.generate(PROMPTS, stops, use_tqdm=False)]
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256, speculative_config=NGRAM)
    with_oracle(llm, PROMPTS, plain)
    outputs = llm.generate(PROMPTS, stops, use_tqdm=False)
    got = [[c.text for c in o.outputs] for o in outputs]
    assert got == want
    assert sum(c.finish_reason == "stop" for o in outputs for c in o.outputs) >= len(PROMPTS)
    assert all(len(texts) == 2 and texts[0] == texts[1] for texts in got)
    assert all(n > 0 for n in draft_counts(llm))
