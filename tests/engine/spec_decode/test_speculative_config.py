"""speculative_config as vLLM takes it (engine/config/speculative.py): a mapping or its
JSON text (a config.pbtxt parameter), vLLM's defaults, and refusals naming the key."""
import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.config.speculative import SpeculativeConfig


def test_vllm_keys_and_defaults():
    config = EngineConfig.from_dict({"speculative_config": {
        "method": "ngram", "num_speculative_tokens": "3", "prompt_lookup_max": 4}})
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    # vLLM's rule: only one bound given, both take it; none given, both 5.
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    both = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    # As a config.pbtxt string parameter, and vLLM's older "[ngram]" spelling.
    text = EngineConfig.from_dict({"speculative_config":
                                   '{"method": "[ngram]", "num_speculative_tokens": 2}'})
    assert text.speculative_config.method == "ngram"
    suffix = SpeculativeConfig.from_value("x", {"method": "suffix"})
    assert suffix.num_speculative_tokens == suffix.suffix_decoding_max_tree_depth == 24
    assert suffix.suffix_decoding_max_cached_requests == 0  # no cross-request text by default
    assert EngineConfig.from_dict({"speculative_config": "null"}).speculative_config is None
    assert EngineConfig(speculative_config={}).speculative_config is None


@pytest.mark.parametrize("value,fragment", [
    ({"method": "eagle9", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 10_000}, "num_speculative_tokens must be <= 64"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 100}, "must be <= 64, got 100"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, r"unknown field\(s\) \['lookahead'\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "prompt_lookup_min=5 must be <= prompt_lookup_max=3"),
    ({"method": "suffix", "prompt_lookup_min": 2}, "only for method 'ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model is required"),
    ({"num_speculative_tokens": 2}, "method is required"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "min_token_prob must be in"),
    ({"method": "ngram", "num_speculative_tokens": "many"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1},
     "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"},
     "draft_sample_method: only for method 'draft_model'"),
    ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2,
      "draft_sample_method": "best"}, "draft_sample_method must be"),
    ("{not json", "must be a JSON object"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_values_are_refused_naming_the_key(value, fragment):
    with pytest.raises(ValueError, match=fragment):
        EngineConfig.from_dict({"speculative_config": value})


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
     "prompt_lookup_min": 2},
    {"method": "suffix", "num_speculative_tokens": 8}], ids=["ngram", "suffix"])
def test_proposers_propose_on_text_the_model_copies(spec):
    """SmolLM2 (trained weights, the embedded model) copies a passage it is asked to
    repeat: n-gram and suffix drafts are accepted, and the output equals decoding without
    them (disable_by_batch_size 0: no step proposes, whatever the batch)."""
    text = "The quick brown fox jumps over the lazy dog near the river bank. " * 2
    prompt = f"Repeat this text exactly: {text}\nRepeated:"
    params = SamplingParams(temperature=0, max_tokens=40)
    llm = LLM(dtype="float32", max_model_len=512, num_kv_blocks=64,
              speculative_config={**spec, "disable_by_batch_size": 1})
    drafted = llm.generate(prompt, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats().spec_decoding
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0
    llm.llm_engine.speculator.config.disable_by_batch_size = 0
    plain = llm.generate(prompt, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().spec_decoding.num_drafts == stats.num_drafts
    assert drafted[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
