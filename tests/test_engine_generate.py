"""LLM.generate end to end on CPU: greedy identity with HF transformers, and the same
identity under preemption, chunked prefill and prefix-cache hits."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.tiny import make_tiny_model_dir

PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a land far away, there lived a",
    "1, 2, 3, 4,",
    "Paris is the capital of",
    "def main():\n    print(",
    "A" * 3,
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def hf_greedy(model_dir, prompt_ids_list, max_new_tokens):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    # Like ignore_eos: never stop early, and do not mask EOS either.
    model.generation_config.eos_token_id = None
    outs = []
    for ids in prompt_ids_list:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), arch=request.param, seed=3)
    return str(path)


def generate_ids(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_matches_hf_in_one_batch(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256, block_size=16)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    assert generate_ids(llm, ids) == hf_greedy(tiny, ids, GREEDY.max_tokens)


def test_preemption_chunking_and_prefix_hits_do_not_change_greedy_output(tiny):
    system = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [system + p for p in PROMPTS] + PROMPTS
    plain = generate_ids(LLM(tiny, dtype="float32", num_kv_blocks=512, enable_prefix_caching=False),
                         prompts)
    stressed_llm = LLM(tiny, dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=150,
                       max_num_batched_tokens=24, long_prefill_token_threshold=7, max_num_seqs=8)
    stressed = generate_ids(stressed_llm, prompts)
    stats = stressed_llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits > 0
    assert stressed == plain
    assert stats.kv_cache_usage == 0.0


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    alone = generate_ids(llm, [PROMPTS[0]], seeded)[0]
    others = SamplingParams(temperature=1.3, max_tokens=10, ignore_eos=True)
    batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, seeded, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    assert generate_ids(llm, [PROMPTS[0]], other_seed)[0] != alone


def test_stop_rules_through_the_engine(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256, max_model_len=64)
    base = generate_ids(llm, [PROMPTS[1]])[0]
    # stop_token_ids: stops at the first occurrence of the 5th generated token
    stop_tok = base[4]
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    first = base.index(stop_tok)
    assert out.outputs[0].token_ids == base[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    # stop strings: cut the text at the first match, without the stop string
    full_text = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full_text[:full_text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                     stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full_text[:full_text.index(stop) + len(stop)]
    # max_model_len caps the total length
    long_prompt = (llm.get_tokenizer().encode(PROMPTS[1]) * 10)[:60]
    out = llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 64 - 60 and out.outputs[0].finish_reason == "length"


def test_min_tokens_holds_back_eos(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256)
    base = generate_ids(llm, [PROMPTS[2]])[0]
    eos = llm.llm_engine.eos_token_id
    # Make the 3rd greedy token a stop id: with min_tokens=6 it must not stop there.
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[base[2]], min_tokens=6,
                            ignore_eos=True)
    out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 6 and base[2] not in out.token_ids[:5]
    assert eos is not None


def test_bad_inputs_raise_clear_errors(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=64, max_model_len=32)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", "", SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("b", list(range(5, 45)), SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("c", [1, 2, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    with pytest.raises(ValueError, match="KV cache too small"):
        LLM(tiny, num_kv_blocks=1, max_model_len=64)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(tiny, not_an_arg=1)
    # Nothing was admitted by the failures; the engine still works.
    assert not engine.has_unfinished_requests()
    assert generate_ids(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4))


def test_streaming_deltas_concatenate_to_final_text(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256)
    engine = llm.llm_engine
    engine.add_request("s", PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    deltas, ids, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].delta_text)
            ids += out.outputs[0].delta_token_ids
            final = out
    assert final.finished and "".join(deltas) == final.outputs[0].text
    assert ids == final.outputs[0].token_ids and len(ids) == 20


def test_abort_frees_blocks_and_failure_switch_aborts_the_step(tiny):
    from engine.llm_engine import EngineStepError
    llm = LLM(tiny, dtype="float32", num_kv_blocks=64, max_model_len=512, inject_failure_at_step=3)
    engine = llm.llm_engine
    engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("y", PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    with pytest.raises(EngineStepError) as info:
        engine.step()
    assert sorted(info.value.failed_request_ids) == ["x", "y"]
    assert engine.get_stats().kv_cache_usage == 0.0 and not engine.has_unfinished_requests()
    # The engine keeps serving correctly afterwards.
    again = generate_ids(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ref = generate_ids(LLM(tiny, dtype="float32", num_kv_blocks=64, max_model_len=512), [PROMPTS[0]],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert again == ref
    engine.add_request("z", PROMPTS[2], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.get_stats().kv_cache_usage > 0
    engine.abort_request("z")
    assert engine.get_stats().kv_cache_usage == 0.0


def test_logprobs_are_returned(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=64, max_model_len=512)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok] <= 0.0
        # greedy: the sampled token is the most likely one
        assert lp[tok] == pytest.approx(max(lp.values()))
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)))


@pytest.mark.slow
def test_smollm2_greedy_matches_hf():
    from engine.models import default_model_dir
    model_dir = str(default_model_dir())
    llm = LLM(None, dtype="float32", num_kv_blocks=512)
    prompts = ["The capital of France is", "Write a haiku about the sea:", "def add(a, b):",
               "List three colors:", "The meaning of life is", "Translate 'hello' to French:",
               "2 + 2 =", "Once upon a time"]
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert generate_ids(llm, ids, params) == hf_greedy(model_dir, ids, 32)
