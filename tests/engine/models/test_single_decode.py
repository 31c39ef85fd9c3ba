"""A single sequence's decode step in one native call (engine/models/single_decode.py)
gives bit-equal results to the layer-by-layer path it skips: same tokens, same logprobs,
same K/V, for dense float32 and bf16 (Llama, Qwen2 with q/k/v biases, Qwen3's q/k norms,
Mistral's window, whose blocks behind it the engine frees while the request runs, Gemma 2
and 3, whose windowed and full layers the engine keeps in KV groups of their own) and
GGUF-quantized weights under float32 and bf16 activations. Step by step, with NaN
placeholders behind windows and GGUF weights on the new families:
test_single_decode_families.py."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.cpu import native as cpu_native
from testing.tiny_model import make_tiny_model_dir

pytestmark = pytest.mark.skipif(cpu_native.load_library() is None,
                                reason="the fused step is a native kernel; no C compiler here")

PROMPTS = ["The quick brown fox", "1, 2, 3, 4,", "Once upon a time in a land far away"]


def one_at_a_time(llm: LLM, single_decode: bool, max_tokens: int = 12):
    """Each prompt alone (the fused step serves batches of one sequence), greedy and sampled.
    Each side gets its own engine: prefix hits from the other's run would change the
    prefill's matmul shapes, and so its rounding."""
    model = llm.llm_engine.runner.model.model
    model.fused_single_decode = single_decode
    results = []
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i,
                                max_tokens=max_tokens, ignore_eos=True, logprobs=4)
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        results.append((out.token_ids, out.logprobs))
    return results, model._single_plan


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
# PROMPTS plus 12 tokens run past mistral-window's window of 12 and the Gemmas' of 10.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral-window", "gemma2",
                                  "gemma3"])
def test_fused_step_is_bit_equal_on_dense_weights(arch, dtype, tmp_path, fused_steps):
    path = make_tiny_model_dir(tmp_path, arch=arch, seed=11, num_hidden_layers=3)

    def engine():
        return LLM(str(path), dtype=dtype, num_kv_blocks=64, block_size=8, max_model_len=128)

    plain, no_plan = one_at_a_time(engine(), False)
    fused, plan = one_at_a_time(engine(), True)
    assert no_plan is None and plan is not None and plan[1] is not None  # it planned
    assert plan[1].dtype == getattr(torch, dtype)
    # And ran every decode: a None would be a step the layer path took instead (the
    # Gemmas get per-layer metadata, their windowed and full layers in KV groups of
    # their own).
    assert fused_steps and all(hidden is not None for _, hidden in fused_steps)
    assert fused == plain  # token ids and logprob floats, exactly


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_step_writes_the_same_kv(arch, dtype, tmp_path):
    path = make_tiny_model_dir(tmp_path, arch=arch, seed=12)
    caches = []
    for single in (False, True):
        llm = LLM(str(path), dtype=dtype, num_kv_blocks=32, block_size=8, max_model_len=128,
                  enable_prefix_caching=False)
        one_at_a_time(llm, single, max_tokens=20)
        caches.append([torch.stack(kv) for kv in llm.llm_engine.runner.kv_caches])
    for a, b in zip(*caches):
        assert torch.equal(a, b)


def test_float16_keeps_the_layer_by_layer_path(tmp_path):
    path = make_tiny_model_dir(tmp_path, arch="llama", seed=13)
    llm = LLM(str(path), dtype="float16", num_kv_blocks=32, block_size=8, max_model_len=128)
    _, plan = one_at_a_time(llm, True, max_tokens=3)
    assert plan is not None and plan[1] is None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_step_is_bit_equal_on_gguf_weights(dtype):
    def engine():
        return LLM(None, dtype=dtype, quantization="gguf", num_kv_blocks=128,
                   max_model_len=512)

    plain, _ = one_at_a_time(engine(), False)
    fused, plan = one_at_a_time(engine(), True)
    assert plan is not None and plan[1] is not None
    assert fused == plain
