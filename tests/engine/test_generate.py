"""LLM.generate end to end on CPU: greedy identity with HF transformers, and the same
identity under preemption, chunked prefill and prefix-cache hits."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.faults import FaultPlan
from testing.hf_reference import hf_causal_lm, hf_greedy_ids
from testing.tiny_model import make_tiny_model_dir

PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a land far away, there lived a",
    "1, 2, 3, 4,",
    "Paris is the capital of",
    "def main():\n    print(",
    "A" * 3,
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


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
    assert generate_ids(llm, ids) == hf_greedy_ids(tiny, ids, GREEDY.max_tokens)


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
    # The same under partial-prefill limits and the preemption shield.
    limited_llm = LLM(tiny, dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=150,
                      max_num_batched_tokens=24, max_num_seqs=8, max_num_partial_prefills=2,
                      max_long_partial_prefills=1, long_prefill_token_threshold=7,
                      shield_resumed=True)
    assert generate_ids(limited_llm, prompts) == plain
    assert limited_llm.llm_engine.get_stats().num_preemptions_total > 0


def test_fair_policy_and_no_evict_admission_do_not_change_greedy_output(tiny):
    if "qwen2" in tiny:
        pytest.skip("scheduling is the same for every architecture; llama's run suffices")
    system = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [system + p for p in PROMPTS] + PROMPTS
    tenants = ["light" if i % 4 == 0 else "heavy" for i in range(len(prompts))]
    pair = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)

    def outputs(llm):
        return [[c.token_ids for c in o.outputs]
                for o in llm.generate(prompts, pair, use_tqdm=False, tenants=tenants)]
    plain = outputs(LLM(tiny, dtype="float32", num_kv_blocks=512, enable_prefix_caching=False))
    stressed = dict(block_size=4, num_kv_blocks=40, max_model_len=150, max_num_batched_tokens=24,
                    long_prefill_token_threshold=7, max_num_seqs=8)
    fair = LLM(tiny, dtype="float32", policy="fair", tenant_weights={"light": 2.0},
               max_num_partial_prefills=2, **stressed)
    assert outputs(fair) == plain
    assert fair.llm_engine.get_stats().num_preemptions_total > 0
    safe = LLM(tiny, dtype="float32", policy="fair", admission="no_evict", **stressed)
    assert outputs(safe) == plain
    assert safe.llm_engine.get_stats().num_preemptions_total == 0
    with pytest.raises(ValueError, match="got 1 tenants for 12 prompts"):
        fair.generate(prompts, pair, tenants=["x"])
    with pytest.raises(ValueError, match="tenant must be a non-empty printable string"):
        fair.generate(prompts[:1], pair, tenants=[""])


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


def first_new_token(ids, start, avoid=()):
    """Index of the first token at or after `start` that appears neither earlier in `ids`
    nor in `avoid`, or None."""
    return next((k for k in range(start, len(ids))
                 if ids[k] not in ids[:k] and ids[k] not in avoid), None)


def test_min_tokens_holds_back_stop_token_ids(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256)
    base = generate_ids(llm, [PROMPTS[0]])[0]
    k = first_new_token(base, 1)
    stop = base[k]
    # The greedy output reaches a stop id at k: with min_tokens=k+3 it must not stop there.
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop],
                            min_tokens=k + 3, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:k] == base[:k] and out.token_ids[k] != stop
    assert len(out.token_ids) >= k + 3 and stop not in out.token_ids[:k + 3]


@pytest.fixture(scope="module")
def two_eos(tiny, tmp_path_factory):
    """A copy of `tiny` whose generation_config lists two EOS ids, [A, B], taken from the
    greedy outputs of two prompts: the first reaches A (and not B) at index k1 >= 1, the
    second B (and not A) at k2 >= 1. Returns (model dir, prompt ids, outputs, [k1, k2])."""
    import itertools
    import json
    import shutil

    llm = LLM(tiny, dtype="float32", num_kv_blocks=256)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    base = generate_ids(llm, prompts)
    choice = None
    # Random weights repeat tokens a lot (qwen2 here: one token 5-20 times in a row).
    for i, j in itertools.permutations(range(len(prompts)), 2):
        b1, b2 = base[i], base[j]
        k1 = first_new_token(b1, 1)
        k2 = first_new_token(b2, 1, avoid=b1[:k1 + 1]) if k1 is not None else None
        if k2 is not None and b1[k1] not in b2[:k2 + 1]:
            choice = (i, j, k1, k2)
            break
    assert choice, "random weights gave no usable pair of EOS candidates"
    i, j, k1, k2 = choice
    path = tmp_path_factory.mktemp("two-eos") / "model"
    shutil.copytree(tiny, path)
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [base[i][k1], base[j][k2]]
    gen_path.write_text(json.dumps(gen))
    return str(path), [prompts[i], prompts[j]], [base[i], base[j]], [k1, k2]


def hf_generate(model_dir, prompt_ids, **kwargs):
    """HF greedy generate with the folder's own generation_config (its EOS list)."""
    model = hf_causal_lm(model_dir, torch.float32)
    with torch.no_grad():
        gen = model.generate(torch.tensor([prompt_ids]), do_sample=False, pad_token_id=0, **kwargs)
    return gen[0, len(prompt_ids):].tolist()


def test_generation_stops_on_every_eos_id_like_hf(two_eos):
    path, prompts, base, stops = two_eos
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    assert llm.llm_engine.eos_token_ids == (base[0][stops[0]], base[1][stops[1]])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for out, ids, b, k in zip(outs, prompts, base, stops):
        # The first EOS id ends prompt 1, the second one prompt 2, EOS token included.
        assert out.outputs[0].token_ids == b[:k + 1] == hf_generate(path, ids, max_new_tokens=24)
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None


def test_min_tokens_holds_back_every_eos_id_like_hf(two_eos):
    path, prompts, base, stops = two_eos
    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    eos_ids = set(llm.llm_engine.eos_token_ids)
    for ids, b, k in zip(prompts, base, stops):
        min_tokens = k + 3
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, min_tokens=min_tokens),
                           use_tqdm=False)[0].outputs[0]
        # Up to k the output is the unmasked one; at k the EOS it wanted is held back.
        assert out.token_ids[:k] == b[:k] and out.token_ids[k] != b[k]
        assert len(out.token_ids) >= min_tokens and not eos_ids & set(out.token_ids[:min_tokens])
        assert out.token_ids == hf_generate(path, ids, max_new_tokens=24, min_new_tokens=min_tokens)


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


def stream_all(engine):
    """Steps until idle; returns {request id: (outputs in order)}."""
    streams = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streams.setdefault(out.request_id, []).append(out)
    return streams


def test_streaming_deltas_concatenate_to_final_output(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256)
    engine = llm.llm_engine
    full = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 4]
    engine.add_request("s", PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.add_request("stop", PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, logprobs=2,
                                                          ignore_eos=True, stop=[stop]))
    for rid, outs in stream_all(engine).items():
        final = outs[-1].outputs[0]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        # Text, tokens and logprobs are released together and add up to the whole.
        assert "".join(o.outputs[0].delta_text for o in outs) == final.text
        assert sum((o.outputs[0].delta_token_ids for o in outs), []) == final.token_ids
        if final.logprobs is not None:
            assert sum((o.outputs[0].delta_logprobs for o in outs), []) == final.logprobs
        assert all(o.outputs[0].delta_token_ids for o in outs[:-1])
    assert final.stop_reason == stop and final.text == full[:full.index(stop)]


def test_stop_id_text_is_left_out_unless_include_stop_str_in_output(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256)
    tok = llm.get_tokenizer()
    base = generate_ids(llm, [PROMPTS[0]])[0]
    k = first_new_token(base, 2)
    params = dict(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[base[k]])
    dropped, kept = (llm.generate([PROMPTS[0]], SamplingParams(**params, include_stop_str_in_output=inc),
                                  use_tqdm=False)[0].outputs[0] for inc in (False, True))
    assert dropped.token_ids == kept.token_ids == base[:k + 1]  # the id is in token_ids (vLLM)
    assert dropped.text == tok.decode(base[:k], skip_special_tokens=True)
    assert kept.text == tok.decode(base[:k + 1], skip_special_tokens=True)
    assert dropped.finished_on_stop_token and dropped.stop_reason == base[k]


def test_stop_token_sequences_through_the_engine(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256)
    base = generate_ids(llm, [PROMPTS[2]])[0]
    k = first_new_token(base, 3)
    sequence = base[k - 1:k + 1]
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    stop_token_sequences=[sequence]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[:k + 1] and out.stop_reason == sequence
    assert not out.finished_on_stop_token
    with pytest.raises(ValueError, match="stop_token_sequences"):
        llm.generate([PROMPTS[2]], SamplingParams(stop_token_sequences=[[10 ** 6]]), use_tqdm=False)


def test_abort_frees_blocks_and_failure_switch_aborts_the_step(tiny):
    from engine.llm_engine import EngineStepError
    llm = LLM(tiny, dtype="float32", num_kv_blocks=64, max_model_len=512,
              faults=FaultPlan(model_step=3))
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


def test_failure_switch_counts_serving_steps_only(tiny):
    from engine.llm_engine import EngineStepError
    # Warm-up runs two batches through the runner before serving; they must not count.
    engine = LLM(tiny, dtype="float32", num_kv_blocks=64, max_model_len=512,
                 faults=FaultPlan(model_step=1)).llm_engine
    engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=4))
    with pytest.raises(EngineStepError):
        engine.step()


def test_logprobs_are_returned(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=64, max_model_len=512)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok].logprob <= 0.0
        # greedy: the sampled token is the most likely one, ranked first as in vLLM
        assert lp[tok].logprob == pytest.approx(max(e.logprob for e in lp.values()))
        assert lp[tok].rank == 1
        assert sorted(e.rank for e in lp.values()) == [1, 2, 3]
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))


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
    assert generate_ids(llm, ids, params) == hf_greedy_ids(model_dir, ids, 32)
