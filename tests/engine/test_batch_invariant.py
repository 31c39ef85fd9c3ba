"""batch_invariant end to end on a tiny random model: a request's tokens and logprobs are
bit-identical run alone, in crowds of changing size, with its prompt chunked, with its
prefix from the cache, with or without the fused single-sequence decode step, and beside
other LoRA adapters' and the base model's rows."""
import pytest

from backend.config_params import split_parameters
from backend.model_json import parse_model_json
from engine import LLM, EngineConfig, LoRARequest, SamplingParams
from kernels.cpu import linear as cpu_linear
from testing.lora_adapter import make_lora_adapter_dir
from testing.tiny_model import make_tiny_model_dir

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 2
TARGETS = [SYSTEM + "The quick brown fox", SYSTEM + "Paris is the capital of",
           "1, 2, 3, 4, 5, 6, 7, 8,"]
FILLERS = ["Once upon a time in a land far away, there lived a", "A" * 30,
           "def main():\n    print(", "x y z " * 12, SYSTEM + "Why?"]
TARGET_PARAMS = [
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3),
    # a seeded random row: top-p's logsumexp and the inverse-CDF cumsum are row reductions
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True,
                   logprobs=2),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0),
]
# block_size is the attention kernel's key block: fixed for a server, so the same here.
COMMON = dict(batch_invariant=True, block_size=8, num_kv_blocks=96, max_model_len=256,
              max_num_seqs=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("llama"), arch="llama", seed=3))


def _results(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].cumulative_logprob)
            for o in outputs]


def _alone(llm):
    return [_results(llm.generate([t], p, use_tqdm=False))[0]
            for t, p in zip(TARGETS, TARGET_PARAMS)]


@pytest.mark.skipif(not cpu_linear.available(), reason="needs the native kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_is_bit_identical_alone_crowded_chunked_and_cached(tiny, dtype):
    solo = LLM(tiny, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=256,
               **COMMON)
    decoder = solo.llm_engine.runner.model.model
    # float32: every row count, one row included, runs the native GEMM's panels
    kind = "invariant-panels" if dtype == "float32" else "invariant"
    assert decoder.layers[0].mlp.down_proj.prepared.kind == kind
    fused = _alone(solo)
    assert decoder._single_plan[1] is not None  # the fused step did run the decodes
    decoder.fused_single_decode = False
    assert _alone(solo) == fused

    crowd = LLM(tiny, dtype=dtype, max_num_batched_tokens=24, long_prefill_token_threshold=7,
                **COMMON)
    filler_params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
                     for i in range(len(FILLERS))]
    # Fillers first: the targets' shared prefix is cached by then, their prompts go in
    # chunks of 7 beside other prefills and decodes, and the batch shrinks as fillers end.
    crowded = crowd.generate(FILLERS + TARGETS, filler_params + TARGET_PARAMS, use_tqdm=False)
    stats = crowd.llm_engine.scheduler.kv_cache_manager.prefix_cache_stats
    assert stats.hits > 0
    assert _results(crowded[len(FILLERS):]) == fused
    # again, all prefixes cached now, targets first and another crowd behind them
    again = crowd.generate(TARGETS + FILLERS[:2], TARGET_PARAMS + filler_params[:2],
                           use_tqdm=False)
    assert _results(again[:len(TARGETS)]) == fused


@pytest.mark.skipif(not cpu_linear.available(), reason="needs the native kernels")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_rows_are_bit_identical_alone_and_mixed_with_other_adapters(tiny, dtype,
                                                                       tmp_path_factory):
    root = tmp_path_factory.mktemp(f"inv-lora-{dtype}")
    adapters = [None, LoRARequest("full", 1, str(make_lora_adapter_dir(tiny, root / "full",
                                                                        seed=1, r=8))),
                LoRARequest("qv", 2, str(make_lora_adapter_dir(
                    tiny, root / "qv", seed=2, r=16, lora_alpha=8,
                    target_modules=("q_proj", "v_proj", "down_proj"))))]
    llm = LLM(tiny, dtype=dtype, enable_lora=True, max_loras=2, max_lora_rank=16,
              max_num_batched_tokens=24, long_prefill_token_threshold=7, **COMMON)
    cases = [(t, p, adapters[(i + j) % 3]) for i, (t, p) in enumerate(zip(TARGETS, TARGET_PARAMS))
             for j in range(3)]
    alone = [_results(llm.generate([t], p, use_tqdm=False, lora_request=lora))[0]
             for t, p, lora in cases]
    # each target under the base and both adapters: each adapter changes some tokens
    ids = {(t, lora and lora.lora_name): got[0] for (t, _, lora), got in zip(cases, alone)}
    for name in ("full", "qv"):
        assert any(ids[t, name] != ids[t, None] for t in TARGETS), name
    crowded = llm.generate([t for t, _, _ in cases], [p for _, p, _ in cases],
                           use_tqdm=False, lora_request=[lora for _, _, lora in cases])
    assert _results(crowded) == alone


def test_the_argument_comes_from_every_source_and_refuses_what_it_cannot_pin():
    assert EngineConfig.from_dict({"batch_invariant": "true"}).batch_invariant is True
    assert EngineConfig().batch_invariant is False
    config, _ = split_parameters({"batch_invariant": "true"})
    assert config.batch_invariant is True
    from_json, _ = split_parameters({}, parse_model_json({"batch_invariant": True}))
    assert from_json.batch_invariant is True
    # tensor parallelism and LoRA keep a row's bits (tests/engine/distributed, above);
    # CUDA's kernels have no invariant variants
    for args in ({"tensor_parallel_size": 3}, {"enable_lora": True}):
        assert EngineConfig.from_dict({"batch_invariant": True, **args}).batch_invariant
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="batch_invariant runs on the CPU only"):
            EngineConfig.from_dict({"batch_invariant": True, "device": device})
