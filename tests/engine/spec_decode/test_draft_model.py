"""The draft_model method on tiny random models (float32): a draft that is the target
itself proposes what greedy decoding gives (every draft kept), a draft cut to one layer
proposes other tokens (drafts rejected), and either way outputs equal decoding without
drafts, also under preemption, chunked prefill and prefix hits. The draft's K/V shares
the target's blocks, so the pool counts both per block; a draft that cannot share the
target's tokenizer or context is refused naming speculative_config.model."""
import pytest

from engine import LLM, SamplingParams
from testing.draft_models import truncated_copy
from testing.tiny_model import make_tiny_model_dir

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived a",
           "1, 2, 3, 4,", "Paris is the capital of", "def main():\n    print(", "A" * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("llama"), arch="llama", seed=3,
                                   num_hidden_layers=3))


@pytest.fixture(scope="module")
def one_layer(tiny, tmp_path_factory):
    return str(truncated_copy(tiny, tmp_path_factory.mktemp("draft"), 1))


def draft_config(model, k=4):
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def token_ids(llm, prompts=PROMPTS, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(tiny):
    return token_ids(LLM(tiny, dtype="float32", num_kv_blocks=256))


def test_the_target_as_its_own_draft_has_every_draft_kept(tiny, plain):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=256, speculative_config=draft_config(tiny))
    assert token_ids(llm) == plain
    stats = llm.llm_engine.get_stats().spec_decoding
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.95


def test_a_weaker_draft_keeps_outputs_under_preemption_chunking_and_prefix_hits(tiny, one_layer):
    system = "You are a helpful assistant. Answer briefly and precisely. " * 3
    prompts = [system + p for p in PROMPTS] + PROMPTS
    expected = token_ids(LLM(tiny, dtype="float32", num_kv_blocks=512,
                             enable_prefix_caching=False), prompts)
    stressed = LLM(tiny, dtype="float32", block_size=4, num_kv_blocks=60, max_model_len=150,
                   max_num_batched_tokens=24, long_prefill_token_threshold=7, max_num_seqs=8,
                   speculative_config=draft_config(one_layer, k=3))
    assert token_ids(stressed, prompts) == expected
    stats = stressed.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    spec = stats.spec_decoding
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_the_pool_counts_the_drafts_bytes_per_block(tiny, one_layer):
    budget = dict(dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=256)
    alone = LLM(tiny, **budget).llm_engine.config.cache.num_kv_blocks
    with_draft = LLM(tiny, speculative_config=draft_config(one_layer), **budget)
    # A layer's K and V of one block: 16 tokens x 2 KV heads x 16 dims x 2 x 4 bytes = 4 KiB;
    # 3 target layers alone, 3 + 1 draft layer with the draft.
    assert alone == (4 << 20) // (3 * 4096)
    assert with_draft.llm_engine.config.cache.num_kv_blocks == (4 << 20) // (4 * 4096)


@pytest.mark.parametrize("overrides,fragment", [
    ({"vocab_size": 49000}, "vocabulary has 49000 tokens"),
    ({"max_position_embeddings": 64}, r"context \(64\) is shorter than max_model_len"),
])
def test_a_draft_that_cannot_serve_the_target_is_refused(tiny, tmp_path, overrides, fragment):
    other = str(make_tiny_model_dir(tmp_path, arch="llama", num_hidden_layers=1, **overrides))
    with pytest.raises(ValueError, match=f"speculative_config.model .*{fragment}"):
        LLM(tiny, dtype="float32", num_kv_blocks=64, max_model_len=256,
            speculative_config=draft_config(other))


def test_probabilistic_drafts_are_kept_more_often_where_requests_sample(tiny):
    """The target as its own draft, sampling at temperature 1: drafts drawn from the
    draft's distribution and weighed with it are kept almost always (p == q); its argmax
    is kept only as often as the target would draw it."""
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
    rates = {}
    for method in ("greedy", "probabilistic"):
        llm = LLM(tiny, dtype="float32", num_kv_blocks=256, speculative_config={
            **draft_config(tiny), "draft_sample_method": method})
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 24 for o in outputs)
        rates[method] = llm.llm_engine.get_stats().spec_decoding.acceptance_rate
    assert rates["probabilistic"] > 0.9 > rates["greedy"] + 0.2
