"""Causal LMs as embedders: the final norm's hidden states, pooled, against transformers'
own forward pooled by hand; through the same scheduler as generation (chunked prefill,
batches past the budget, prefix-cache hits, preemption), and the runner rules."""
import pytest
import torch

from engine import LLM, LLMEngine, PoolingParams, SamplingParams
from tests.engine.pooling.conftest import assert_close_vectors, hf_hidden, pool

PROMPTS = ["The quick brown fox jumps over the lazy dog",
           "Hello",
           "Once upon a time in a land far away, there lived a king who",
           "1, 2, 3, 4, 5, 6, 7, 8,",
           "Paris is the capital of"]
SMALL = dict(dtype="float32", block_size=4, num_kv_blocks=128, max_model_len=128)


def references(model_dir, tokenizer, prompts, mode):
    ids = [tokenizer.encode(p) for p in prompts]
    return [pool(h, mode) for h in hf_hidden(model_dir, [{"input_ids": i} for i in ids])]


@pytest.mark.parametrize("folder, mode", [("qwen3_dir", "last"), ("llama_mean_dir", "mean")])
@pytest.mark.parametrize("budget", [2048, 7])
def test_embeddings_match_transformers_whole_or_chunked(folder, mode, budget, request):
    model_dir = request.getfixturevalue(folder)
    llm = LLM(str(model_dir), max_num_batched_tokens=budget, **SMALL)
    assert llm.llm_engine.runner_type == "pooling"  # runner auto: the folder's modules.json
    outs = llm.embed(PROMPTS)
    for out, ref in zip(outs, references(model_dir, llm.get_tokenizer(), PROMPTS, mode)):
        assert_close_vectors(out.outputs.embedding, ref)
    # Finished requests hold no blocks and leave no pooling state behind.
    engine = llm.llm_engine
    assert engine.scheduler.kv_cache_manager.usage == 0.0
    assert len(engine.runner.pooler) == 0


@pytest.mark.parametrize("family", ["gemma2", "mistral-window", "olmo2"])
def test_other_families_chunked(family, tmp_path):
    """Gemma 2: two KV-cache groups (windowed, full), so per-group metadata; Mistral: a
    window shorter than the prompts, its blocks freed mid-prompt; OLMo 2: the general
    path (transformers' classes)."""
    from testing.tiny_hf_model import make_tiny_hf_dir
    from testing.tiny_model import make_tiny_model_dir
    model_dir = (make_tiny_hf_dir(tmp_path / family, family, seed=1) if family == "olmo2"
                 else make_tiny_model_dir(tmp_path / family, arch=family, seed=1))
    llm = LLM(str(model_dir), runner="pooling", max_num_batched_tokens=7, **SMALL)
    prompts = [PROMPTS[2] + " " + PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    outs = llm.embed(prompts)
    for out, ref in zip(outs, references(model_dir, llm.get_tokenizer(), prompts, "last")):
        assert_close_vectors(out.outputs.embedding, ref)


def test_a_batch_past_the_budget_chunks_within_it(llama_mean_dir):
    prompts = PROMPTS * 4
    engine = LLMEngine(model=str(llama_mean_dir), max_num_batched_tokens=16, **SMALL)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p)
    results, steps = {}, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        assert 0 < engine.last_step_num_tokens <= 16
        results.update((o.request_id, o.outputs.data) for o in outs)
    assert steps >= sum(len(engine.tokenizer.encode(p)) for p in prompts) // 16
    refs = references(llama_mean_dir, engine.tokenizer, prompts, "mean")
    for i, ref in enumerate(refs):
        assert_close_vectors(results[str(i)], ref)
    # MEAN reads every position: prefix caching is off (vLLM's rule).
    assert engine.config.cache.enable_prefix_caching is False
    assert engine.get_stats().prefix_cache_hits == 0


def test_last_token_pooling_reads_prefix_cache_hits(qwen3_dir):
    system = "You are a helpful assistant. Answer briefly and precisely. " * 2
    prompts = [system + p for p in PROMPTS]
    llm = LLM(str(qwen3_dir), **SMALL)
    first = llm.embed(prompts[:1])
    second = llm.embed(prompts + prompts[:1])
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits > 0
    # A fully cached prompt still computes its last position (the scheduler always
    # leaves one token), which is the one last-token pooling reads.
    length = len(first[0].prompt_token_ids)
    assert second[-1].num_cached_tokens == (length - 1) // 4 * 4
    refs = references(qwen3_dir, llm.get_tokenizer(), prompts, "last")
    for out, ref in zip(second, refs + refs[:1]):
        assert_close_vectors(out.outputs.embedding, ref)


def test_preemption_recomputes_from_the_start(llama_mean_dir):
    long_prompts = [p * 6 for p in PROMPTS]  # 6 to 138 tokens
    # Every prompt starts at once, 4 tokens a step each, in a pool that holds one long
    # prompt and a bit: the running ones run out of blocks and the latest is preempted.
    llm = LLM(str(llama_mean_dir), dtype="float32", block_size=4, num_kv_blocks=40,
              max_model_len=150, max_num_batched_tokens=40, long_prefill_token_threshold=4)
    outs = llm.embed(long_prompts)
    assert llm.llm_engine.get_stats().num_preemptions_total > 0
    refs = references(llama_mean_dir, llm.get_tokenizer(), long_prompts, "mean")
    for out, ref in zip(outs, refs):
        assert_close_vectors(out.outputs.embedding, ref)


def test_a_plain_causal_lm_pools_its_last_token_normalised(tmp_path):
    from testing.tiny_model import make_tiny_model_dir
    model_dir = make_tiny_model_dir(tmp_path / "llama", arch="llama", seed=6)
    llm = LLM(str(model_dir), runner="pooling", **SMALL)  # convert auto -> embed
    outs = llm.embed(PROMPTS[:2])
    for out, ref in zip(outs, references(model_dir, llm.get_tokenizer(), PROMPTS[:2], "last")):
        assert_close_vectors(out.outputs.embedding, ref)
    # The lm_head is never read: not even loaded.
    assert llm.llm_engine.loaded.model.lm_head_weight is None
    with pytest.raises(ValueError, match=r"prompt 0: prompt has 129 tokens, more than "
                                         r"max_model_len=128"):
        llm.embed([[5] * 129])
    with pytest.raises(ValueError, match="prompt 0: prompt is empty"):
        llm.embed([""])
    (full,) = llm.embed([[5] * 128])  # a pooling prompt may fill max_model_len
    assert len(full.prompt_token_ids) == 128


def test_one_runner_per_engine(qwen3_dir, tmp_path):
    pooling = LLM(str(qwen3_dir), **SMALL)
    with pytest.raises(ValueError, match="LLM.generate\\(\\) needs runner='generate'"):
        pooling.generate(["Hello"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="runner='generate'"):
        pooling.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="takes PoolingParams, got SamplingParams"):
        pooling.llm_engine.add_request("x", "Hello", SamplingParams(max_tokens=2))
    generating = LLM(str(qwen3_dir), runner="generate", **SMALL)
    assert generating.llm_engine.runner_type == "generate"
    with pytest.raises(ValueError, match="LLM.embed\\(\\) needs runner='pooling'"):
        generating.embed(["Hello"])
    with pytest.raises(ValueError, match="LLM.score\\(\\) needs runner='pooling'"):
        generating.score("a", "b")
    with pytest.raises(ValueError, match="PoolingParams: this engine runs runner='generate'"):
        generating.llm_engine.add_request("x", "Hello", PoolingParams())
    out = generating.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="convert='none'"):
        LLM(str(qwen3_dir), runner="pooling", convert="none", **SMALL)


def test_embeddings_do_not_depend_on_batch_mates(qwen3_dir):
    llm = LLM(str(qwen3_dir), max_num_batched_tokens=9, **SMALL)
    alone = [llm.embed([p])[0].outputs.embedding for p in PROMPTS]
    together = [o.outputs.embedding for o in llm.embed(PROMPTS[::-1])][::-1]
    for a, b in zip(alone, together):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
