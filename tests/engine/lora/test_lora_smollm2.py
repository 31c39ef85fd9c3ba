"""LoRA on the real SmolLM2-135M: greedy tokens per adapter equal HF + peft's (fp32), and
the same adapters over the GGUF-quantized base (Q4_1 / Q8_0 blocks, float adapters) stay
as close to them as the quantized base stays to the dense one. Slow: 30 layers."""
from __future__ import annotations

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.models import default_model_dir
from testing.lora_adapter import hf_peft_greedy, make_lora_adapter_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-lora")
    base = default_model_dir()
    return {"a": make_lora_adapter_dir(base, root / "a", seed=1, r=16, lora_alpha=16),
            "b": make_lora_adapter_dir(base, root / "b", seed=2, r=8, lora_alpha=4,
                                       target_modules=("q_proj", "v_proj", "o_proj"))}


def greedy(llm, prompts, loras):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False,
                                                         lora_request=loras)]


def test_smollm2_adapters_mixed_with_the_base_match_peft(adapters):
    base = default_model_dir()
    llm = LLM(str(base), dtype="float32", num_kv_blocks=128, max_model_len=256,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    want = {name: hf_peft_greedy(base, path, ids, GREEDY.max_tokens)
            for name, path in adapters.items()}
    want[None] = hf_peft_greedy(base, None, ids, GREEDY.max_tokens)
    assert want["a"] != want[None] and want["b"] != want[None]
    requests = {None: None, **{n: LoRARequest(n, i + 1, str(p))
                               for i, (n, p) in enumerate(adapters.items())}}
    names = [None, "a", "b"]
    prompts = [p for p in ids for _ in names]
    loras = [requests[n] for _ in ids for n in names]
    expected = [want[n][i] for i in range(len(ids)) for n in names]
    assert greedy(llm, prompts, loras) == expected


def test_gguf_base_with_float_adapters(adapters):
    kwargs = dict(dtype="float32", num_kv_blocks=128, max_model_len=256, enable_lora=True,
                  max_loras=2, max_lora_rank=16)
    dense = LLM(None, **kwargs)
    quantized = LLM(None, quantization="gguf", **kwargs)
    ids = [dense.get_tokenizer().encode(p) for p in PROMPTS]
    lora = LoRARequest("a", 1, str(adapters["a"]))
    want = greedy(dense, ids, lora)
    got = greedy(quantized, ids, lora)
    base = greedy(quantized, ids, None)
    assert got != base  # the adapter runs on the quantized layers too
    # As tests/engine/models/test_gguf_quantized.py allows the bare quantized base.
    assert [g[:3] for g in got] == [w[:3] for w in want]
    same = sum(x == y for g, w in zip(got, want) for x, y in zip(g, w))
    assert same >= 0.75 * GREEDY.max_tokens * len(PROMPTS)
