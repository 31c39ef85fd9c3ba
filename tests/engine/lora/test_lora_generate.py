"""Multi-LoRA generation against HF + peft: greedy tokens per adapter, several adapters
and the base model mixed in one batch, and the same under chunked prefill, preemption
and prefix hits; two adapters never share KV."""
import pytest

from engine import LLM, LoRARequest, SamplingParams
from testing.lora_adapter import hf_peft_greedy, make_lora_adapter_dir
from testing.tiny_model import make_tiny_model_dir

PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a land far away, there lived a",
    "1, 2, 3, 4,",
    "Paris is the capital of",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = make_tiny_model_dir(root / "base", arch=request.param, seed=3)
    adapters = {
        "full": make_lora_adapter_dir(base, root / "full", seed=1, r=8),
        # Part of the fused layers only (PEFT's usual q/v), another rank and rsLoRA.
        "qv": make_lora_adapter_dir(base, root / "qv", seed=2, r=16, lora_alpha=8,
                                    target_modules=("q_proj", "v_proj", "down_proj"),
                                    use_rslora=True),
    }
    llm = LLM(str(base), dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=2,
              max_lora_rank=16)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    expected = {name: hf_peft_greedy(base, path, ids, GREEDY.max_tokens)
                for name, path in adapters.items()}
    expected[None] = hf_peft_greedy(base, None, ids, GREEDY.max_tokens)
    requests = {name: LoRARequest(name, i + 1, str(path))
                for i, (name, path) in enumerate(adapters.items())}
    requests[None] = None
    return dict(base=str(base), llm=llm, ids=ids, expected=expected, requests=requests)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_matches_peft(setup):
    llm, ids, expected = setup["llm"], setup["ids"], setup["expected"]
    for name, lora in setup["requests"].items():
        assert token_ids(llm.generate(ids, GREEDY, use_tqdm=False, lora_request=lora)) \
            == expected[name], name
    # The adapters do change the outputs (else the comparison above proves nothing).
    assert expected["full"] != expected[None] and expected["qv"] != expected[None]


def mixed_batch(setup):
    """Every prompt under every adapter and the base, interleaved in one batch."""
    names = list(setup["requests"])
    prompts, loras, want = [], [], []
    for i, prompt in enumerate(setup["ids"]):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            prompts.append(prompt)
            loras.append(setup["requests"][name])
            want.append(setup["expected"][name][i])
    return prompts, loras, want


def test_adapters_and_base_mixed_in_one_batch_match_peft(setup):
    prompts, loras, want = mixed_batch(setup)
    assert token_ids(setup["llm"].generate(prompts, GREEDY, use_tqdm=False,
                                           lora_request=loras)) == want


def test_mixed_batch_under_chunking_preemption_and_prefix_hits(setup):
    prompts, loras, want = mixed_batch(setup)
    llm = LLM(setup["base"], dtype="float32", block_size=4, num_kv_blocks=24, max_model_len=64,
              max_num_batched_tokens=12, long_prefill_token_threshold=5, max_num_seqs=6,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    # Twice: the second round hits the first round's cached blocks.
    for _ in range(2):
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) == want
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits > 0


def test_two_adapters_with_one_prompt_never_share_kv(setup):
    """The same prompt under the base, then each adapter: a prefix key that ignored the
    adapter would hand the base model's KV to the adapters and change their tokens."""
    llm = LLM(setup["base"], dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=64,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    prompt = setup["ids"][1]
    engine = llm.llm_engine
    for name in (None, "full", "qv", "full"):
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=setup["requests"][name])
        assert out[0].outputs[0].token_ids == setup["expected"][name][1], name
    kv = engine.scheduler.kv_cache_manager
    # Only the second "full" run may hit (its own adapter's blocks): the prompt's full
    # blocks once, out of four lookups.
    full_blocks = (len(prompt) - 1) // 4 * 4
    assert kv.prefix_cache_stats.hits == full_blocks


def test_one_adapter_slot_and_one_loaded_adapter_still_match_peft(setup):
    """max_loras=1: the adapters take turns (requests for the running one and the base go
    on meanwhile); max_cpu_loras=1: each turn reloads its adapter from its folder."""
    prompts, loras, want = mixed_batch(setup)
    llm = LLM(setup["base"], dtype="float32", num_kv_blocks=128, max_model_len=64,
              enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16)
    engine = llm.llm_engine
    seen = []
    original = engine.scheduler.schedule

    def watched():
        out = original()
        seen.append({r.lora_request.lora_int_id for r in engine.scheduler.running
                     if r.lora_request is not None})
        return out

    engine.scheduler.schedule = watched  # observes; the real scheduler still decides
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) == want
    assert max(len(s) for s in seen) == 1 and {1, 2} == set().union(*seen)
    assert engine.lora.registry.num_loads > 2


def test_the_request_trace_names_the_adapter(setup, tmp_path):
    import json

    path = tmp_path / "trace.jsonl"
    llm = LLM(setup["base"], dtype="float32", num_kv_blocks=64, max_model_len=64,
              enable_lora=True, max_lora_rank=16, trace_path=str(path))
    prompt = setup["ids"][0]
    llm.generate([prompt, prompt], GREEDY, use_tqdm=False,
                 lora_request=[setup["requests"]["full"], None])
    llm.llm_engine.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(str(r["lora_name"]) for r in records if r["type"] == "request") \
        == ["None", "full"]
