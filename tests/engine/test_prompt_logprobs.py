"""SamplingParams.prompt_logprobs end to end on CPU: every prompt position against HF
transformers' log_softmax (float32, eager), alone, batched beside decodes, chunked, over
a cached prefix, preempted, with n > 1, streamed, under tensor parallelism; the layout
(None first, the prompt token first, ranks), validation, and sampled outputs unchanged."""
import dataclasses

import pytest
import torch

from engine import LLM, LLMEngine, RequestOutputKind, SamplingParams
from engine.core.kv_cache.manager import KVCacheManager
from engine.core.request import Request
from engine.sample.prompt_logprobs import slice_rows
from testing.hf_reference import hf_causal_lm
from testing.tiny_model import make_tiny_model_dir

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 3
PROMPTS = [SYSTEM + "The quick brown fox", "Once upon a time in a land far away, there lived a",
           SYSTEM + "Paris is the capital of", "1, 2, 3, 4,"]
TOL = 2e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("llama"), arch="llama", seed=3))


@pytest.fixture(scope="module")
def hf(tiny):
    model = hf_causal_lm(tiny)
    cache = {}

    def reference(ids):
        """HF's log_softmax [len(ids), vocab] of one prompt, float32."""
        key = tuple(ids)
        if key not in cache:
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
            cache[key] = torch.log_softmax(logits, dim=-1)
        return cache[key]
    return reference


def check_against_hf(out, k, reference):
    """Position i's entries against HF's distribution at position i - 1."""
    ids = out.prompt_token_ids
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    want = reference(ids)
    for i in range(1, len(ids)):
        entries, row = plp[i], want[i - 1]
        token = ids[i]
        assert next(iter(entries)) == token  # the prompt's token first
        got = entries[token]
        assert abs(got.logprob - row[token].item()) < TOL
        # The sampler's rank rule, allowing for float noise between two implementations.
        assert (row >= got.logprob + 1e-4).sum().item() + 1 <= got.rank
        assert got.rank <= (row >= got.logprob - 1e-4).sum().item()
        # k entries when the token is among the top k (its entry took its top-k place).
        top = list(entries.items()) if len(entries) == k else list(entries.items())[1:]
        top.sort(key=lambda item: item[1].rank)
        assert [e.rank for _, e in top] == list(range(1, k + 1))
        best = row.topk(k).values.tolist() if k else []
        for (t, e), value in zip(top, best, strict=True):
            assert abs(e.logprob - value) < TOL and abs(row[t].item() - e.logprob) < TOL


def prompt_ids(llm_or_engine, prompts=PROMPTS):
    tok = getattr(llm_or_engine, "llm_engine", llm_or_engine).tokenizer
    return [tok.encode(p) for p in prompts]


def test_alone_long_and_one_token_prompts_match_hf(tiny, hf):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=1024)
    ids = prompt_ids(llm)
    # Longer than two slices of lm_head rows, in one chunk.
    long_ids = (ids[0] * 10)[:2 * slice_rows(llm.llm_engine.loaded.vocab_size) + 20]
    for prompt, k in ((ids[1], 5), (long_ids, 2), (ids[3], 0)):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3,
                                                    prompt_logprobs=k), use_tqdm=False)[0]
        check_against_hf(out, k, hf)
        if k == 0:
            assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    one = llm.generate([[ids[0][0]]], SamplingParams(max_tokens=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]
    plain = llm.generate([ids[1]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


def test_batched_beside_decodes_and_chunked_match_hf(tiny, hf):
    # A 10-token budget: every prompt here takes several chunks, beside running decodes.
    engine = LLMEngine(model=tiny, dtype="float32", num_kv_blocks=256,
                       max_num_batched_tokens=10, enable_prefix_caching=False)
    ids = prompt_ids(engine)
    engine.add_request("decoding", ids[3], SamplingParams(temperature=0, max_tokens=40))
    for _ in range(3):
        engine.step()
    params = [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3),
              SamplingParams(temperature=0, max_tokens=4),
              SamplingParams(temperature=0.8, seed=1, max_tokens=4, prompt_logprobs=1,
                             logprobs=2),
              SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)]
    for i, (prompt, p) in enumerate(zip(ids, params)):
        engine.add_request(str(i), prompt, p)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for i, p in enumerate(params):
        out = finals[str(i)]
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            check_against_hf(out, p.prompt_logprobs, hf)


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(tiny, hf):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256, block_size=4, max_model_len=256)
    ids = prompt_ids(llm)
    llm.generate([ids[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate([ids[2]], SamplingParams(max_tokens=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check_against_hf(out, 2, hf)
    # The cache was there to hit: a request without prompt_logprobs does.
    again = llm.generate([ids[2]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0


def test_the_kv_manager_skips_lookups_for_prompt_logprobs():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = Request("a", list(range(12)))
    kv.allocate_slots(first, 12)
    assert kv.get_computed_blocks(Request("b", list(range(12))))[1] == 8
    asks = Request("c", list(range(12)), SamplingParams(prompt_logprobs=0))
    assert kv.get_computed_blocks(asks)[1] == 0


def test_preemption_and_chunking_give_bit_identical_prompt_logprobs(tiny):
    # batch_invariant: a request's numbers do not depend on its chunks, so equal bits.
    args = dict(dtype="float32", batch_invariant=True, block_size=4, max_model_len=150)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2)
    prompts = PROMPTS + [SYSTEM + "Why?", SYSTEM + "1, 2, 3"]
    plain = LLM(tiny, num_kv_blocks=512, enable_prefix_caching=False, **args)
    want = plain.generate(prompts, params, use_tqdm=False)
    stressed = LLM(tiny, num_kv_blocks=40, max_num_batched_tokens=24,
                   long_prefill_token_threshold=7, max_num_seqs=8, **args)
    got = stressed.generate(prompts, params, use_tqdm=False)
    assert stressed.llm_engine.get_stats().num_preemptions_total > 0
    assert any(o.metrics.num_preemptions for o in got)
    for g, w in zip(got, want):
        assert g.prompt_logprobs == w.prompt_logprobs
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def test_sampled_outputs_do_not_change_with_prompt_logprobs(tiny):
    # Without prefix caching both runs schedule the same chunks (prompt_logprobs turns
    # prefix hits off, and a hit changes the float bits of what follows it).
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    kinds = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True,
                            logprobs=1)]
    for p in kinds:
        with_plp = dataclasses.replace(p, prompt_logprobs=4)
        a = llm.generate(PROMPTS, p, use_tqdm=False)
        b = llm.generate(PROMPTS, with_plp, use_tqdm=False)
        assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in a] == \
            [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in b]


def test_n_children_and_output_kinds_carry_them(tiny, hf):
    engine = LLMEngine(model=tiny, dtype="float32", num_kv_blocks=256, block_size=4,
                       max_model_len=256)
    ids = prompt_ids(engine)[0]
    seen = {}
    for kind in RequestOutputKind:
        for n in (1, 3):
            rid = f"{kind.name}-{n}"
            engine.add_request(rid, ids, SamplingParams(n=n, max_tokens=5, ignore_eos=True,
                                                        prompt_logprobs=1, output_kind=kind))
            seen[rid] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert engine.get_stats().prefix_cache_hits > 0  # n > 1 siblings hit child 0's blocks
    reference = None
    for rid, outs in seen.items():
        carrying = [o for o in outs if o.prompt_logprobs is not None]
        if rid.startswith("DELTA"):
            assert len(carrying) == 1
        elif rid.startswith("CUMULATIVE"):
            assert outs[-1].prompt_logprobs is not None
            assert all(o.prompt_logprobs is not None for o in outs[outs.index(carrying[0]):])
        else:
            assert len(outs) == 1 and carrying
        check_against_hf(carrying[0], 1, hf)
        reference = reference or carrying[0].prompt_logprobs
        assert carrying[0].prompt_logprobs == reference


def test_no_prompt_logprobs_state_outlives_finished_and_aborted_requests(tiny):
    engine = LLMEngine(model=tiny, dtype="float32", num_kv_blocks=64, max_model_len=256,
                       max_num_batched_tokens=8)
    ids = prompt_ids(engine)
    for i, prompt in enumerate(ids):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=3, prompt_logprobs=1))
    engine.step()
    tracker = engine.runner.prompt_logprobs
    assert tracker._pending  # mid-prefill
    aborted = engine.abort_request("0")  # mid-prefill: no prompt logprobs to give
    assert aborted[0].finished and aborted[0].prompt_logprobs is None
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # hands the runner the finished ids
    assert not tracker._pending and not tracker._delivered


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_values_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_more_than_max_logprobs_is_refused(tiny):
    engine = LLMEngine(model=tiny, dtype="float32", num_kv_blocks=64, max_logprobs=4,
                       max_model_len=256)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be <= max_logprobs \(4\)"):
        engine.add_request("r", [1, 2, 3], SamplingParams(prompt_logprobs=5))
    engine.add_request("r", [1, 2, 3], SamplingParams(prompt_logprobs=4))


@pytest.mark.timeout(240)
def test_two_tensor_parallel_ranks_match_one(tiny):
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    one = LLM(tiny, dtype="float32", num_kv_blocks=256).generate(PROMPTS, params,
                                                                  use_tqdm=False)
    tp = LLM(tiny, dtype="float32", num_kv_blocks=256, tensor_parallel_size=2,
             max_num_batched_tokens=16)
    try:
        two = tp.generate(PROMPTS, params, use_tqdm=False)
    finally:
        tp.llm_engine.close()
    for a, b in zip(one, two):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            token = next(iter(x))
            assert next(iter(y)) == token
            assert abs(x[token].logprob - y[token].logprob) < 1e-4


@pytest.mark.slow
def test_smollm2_float32_matches_hf():
    from engine.models import default_model_dir
    llm = LLM(None, dtype="float32", num_kv_blocks=256, max_model_len=1024,
              max_num_batched_tokens=32)
    ids = prompt_ids(llm)[:2]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5),
                        use_tqdm=False)
    model = hf_causal_lm(default_model_dir())

    def reference(prompt):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for out in outs:
        check_against_hf(out, 5, reference)
