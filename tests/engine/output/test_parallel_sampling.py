"""n > 1 on the real engine (tiny random-weight Llama): seeds, prefill once, streaming
deltas per sequence, aborts and failures of the whole family."""
import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.faults import FaultPlan
from engine.llm_engine import EngineStepError
from engine.output.parallel_sampling import child_seed, fan_out
from engine.sampling_params import SEED_MAX
from testing.tiny_model import make_tiny_model_dir

BLOCK = 16
PROMPT_IDS = list(range(300, 350))  # 50 tokens: 3 full blocks and a 2-token tail
SAMPLED = dict(temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("llama"), seed=3))


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, dtype="float32", num_kv_blocks=256, block_size=BLOCK)


def ids_of(output):
    return [c.token_ids for c in output.outputs]


def test_seeded_n_gives_n_reproducible_outputs_equal_to_seed_plus_index(llm):
    params = SamplingParams(n=3, seed=11, logprobs=0, **SAMPLED)
    first = llm.generate([PROMPT_IDS], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(ids) for ids in ids_of(first)}) == 3
    assert all(c.finish_reason == "length" and len(c.token_ids) == 12 for c in first.outputs)
    again = llm.generate([PROMPT_IDS], params, use_tqdm=False)[0]
    assert ids_of(again) == ids_of(first)
    # vLLM's rule: child i samples as a lone request seeded seed + i.
    singles = llm.generate([PROMPT_IDS] * 3, [SamplingParams(seed=11 + i, logprobs=0, **SAMPLED)
                                              for i in range(3)], use_tqdm=False)
    assert ids_of(first) == [s.outputs[0].token_ids for s in singles]
    for merged, single in zip(first.outputs, singles):
        assert merged.cumulative_logprob == pytest.approx(single.outputs[0].cumulative_logprob)
        assert len(merged.logprobs) == 12


def test_greedy_n_gives_identical_outputs(llm):
    greedy = dict(temperature=0, max_tokens=10, ignore_eos=True)
    two = llm.generate("The quick brown fox", SamplingParams(n=2, **greedy), use_tqdm=False)[0]
    one = llm.generate("The quick brown fox", SamplingParams(**greedy), use_tqdm=False)[0]
    assert [c.text for c in two.outputs] == [one.outputs[0].text] * 2
    assert two.prompt == "The quick brown fox" and two.prompt_token_ids == one.prompt_token_ids


def test_the_prompt_is_prefilled_once(tiny):
    engine = LLMEngine(model=tiny, dtype="float32", num_kv_blocks=256, block_size=BLOCK)
    before = engine.get_stats()
    engine.add_request("p", PROMPT_IDS, SamplingParams(n=3, seed=1, **SAMPLED))
    outputs = engine.step()
    stats = engine.get_stats()
    # All three admitted in the first step, each sampled its first token there.
    assert [len(o.outputs) for o in outputs] == [3]
    assert stats.generation_tokens_total - before.generation_tokens_total == 3
    queried = stats.prefix_cache_queries - before.prefix_cache_queries
    hit = stats.prefix_cache_hits - before.prefix_cache_hits
    full_blocks = (len(PROMPT_IDS) - 1) // BLOCK * BLOCK
    assert queried == 3 * len(PROMPT_IDS)
    assert hit == 2 * full_blocks  # the siblings hit every full block of the first
    # Computed prompt tokens: the prompt once, plus each sibling's 2-token tail.
    assert queried - hit == len(PROMPT_IDS) + 2 * (len(PROMPT_IDS) - full_blocks)
    assert stats.prompt_tokens_total - before.prompt_tokens_total == len(PROMPT_IDS)
    engine.abort_request("p")


def test_stream_deltas_per_index_concatenate_to_final_texts(tiny):
    engine = LLMEngine(model=tiny, dtype="float32", num_kv_blocks=256, block_size=BLOCK)
    engine.add_request("solo", "Hello there", SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("p", "Once upon a time", SamplingParams(n=3, seed=5, logprobs=1, **SAMPLED))
    streamed, token_ids, final, solo_done = ["", "", ""], [[], [], []], None, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "solo":
                solo_done |= out.finished
                continue
            assert out.request_id == "p" and final is None
            assert [c.index for c in out.outputs] == [0, 1, 2]
            for c in out.outputs:
                streamed[c.index] += c.delta_text
                token_ids[c.index] += c.delta_token_ids
                assert len(c.delta_logprobs) == len(c.delta_token_ids)
            if out.finished:
                final = out
    assert solo_done and final is not None
    assert streamed == [c.text for c in final.outputs]
    assert token_ids == ids_of(final)
    assert engine.get_stats().kv_cache_usage == 0.0


def test_abort_of_the_parent_ends_every_sequence_and_frees_every_block(tiny):
    engine = LLMEngine(model=tiny, dtype="float32", num_kv_blocks=256, block_size=BLOCK)
    engine.add_request("p", PROMPT_IDS, SamplingParams(n=4, **SAMPLED))
    engine.step()
    engine.step()
    assert engine.get_stats().num_running == 4 and engine.get_stats().kv_cache_usage > 0
    aborted = engine.abort_request("p")
    assert [o.request_id for o in aborted] == ["p"] and aborted[0].finished
    assert [c.finish_reason for c in aborted[0].outputs] == ["abort"] * 4
    assert all(len(c.token_ids) == 2 for c in aborted[0].outputs)
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage == 0.0
    assert engine.abort_request("p") == []
    engine.add_request("p", PROMPT_IDS, SamplingParams(n=2, **SAMPLED))  # the id is free again
    engine.abort_request(["p"])


def test_a_failed_step_fails_the_request_once_by_its_own_id(tiny):
    engine = LLMEngine(model=tiny, dtype="float32", num_kv_blocks=256, block_size=BLOCK,
                       faults=FaultPlan(model_step=3))
    engine.add_request("p", PROMPT_IDS, SamplingParams(n=3, **SAMPLED))
    engine.add_request("q", "Hi", SamplingParams(max_tokens=8))
    engine.step()
    engine.step()
    with pytest.raises(EngineStepError) as failure:
        engine.step()
    assert sorted(failure.value.failed_request_ids) == ["p", "q"]
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage == 0.0
    assert engine.abort_request(["p", "q"]) == []


def test_request_ids_of_a_family_are_reserved(llm):
    engine = llm.llm_engine
    engine.add_request("x", "Hi", SamplingParams(n=2))
    for taken in ("x", "0_x", "1_x"):
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request(taken, "Hi", SamplingParams())
    engine.add_request("y", "Hi", SamplingParams(n=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", "Hi", SamplingParams(n=1))
    engine.abort_request(["x", "y"])
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("n", [0, 17, 2.0, True, "2"])
def test_n_is_validated(n):
    with pytest.raises(ValueError, match="SamplingParams.n "):
        SamplingParams(n=n)


def test_child_seeds_follow_vllm_and_wrap_at_the_top_of_the_range():
    assert [p.seed for _, p in fan_out("r", SamplingParams(n=3, seed=7))] == [7, 8, 9]
    assert [rid for rid, _ in fan_out("r", SamplingParams(n=2))] == ["0_r", "1_r"]
    assert fan_out("r", SamplingParams(seed=7)) == [("r", SamplingParams(seed=7))]
    assert child_seed(None, 3) is None
    assert child_seed(SEED_MAX, 1) == SEED_MAX + 1 - 2 ** 64
    assert all(p.n == 1 for _, p in fan_out("r", SamplingParams(n=3, seed=SEED_MAX)))
