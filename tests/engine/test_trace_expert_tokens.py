"""The workload trace's per-step expert counts (engine/metrics/trace.py, ExpertLoad in
engine/models/moe.py): with tracing on, each step record of an MoE model carries, per MoE
layer, the token slots the router sent each expert; with it off the blocks count nothing."""
import json

import pytest

from engine import LLM, SamplingParams
from engine.models.moe import FusedMoE
from testing.tiny_model import make_tiny_model_dir

PROMPTS = ["The quick brown fox jumps over the lazy dog " * 3, "1, 2, 3, 4,",
           "Once upon a time in a land far away, there lived a"]


@pytest.mark.parametrize("arch, moe_layers", [("mixtral", 2), ("qwen3-moe", 1)])
def test_step_counts_sum_to_tokens_times_top_k_times_moe_layers(arch, moe_layers, tmp_path):
    # qwen3-moe: layer 1 is dense, so one list per step, not two
    path = make_tiny_model_dir(tmp_path / arch, arch=arch, seed=3)
    trace = tmp_path / "trace.jsonl"
    llm = LLM(str(path), dtype="float32", trace_path=str(trace), num_kv_blocks=64,
              max_model_len=128, max_num_batched_tokens=16)  # chunked: mixed steps
    try:
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                     use_tqdm=False)
    finally:
        llm.llm_engine.close()
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if r["type"] == "step"]
    assert len(steps) > 3 and any(s["num_prefills"] and s["decode_tokens"] for s in steps)
    for step in steps:
        counts = step["expert_tokens"]
        tokens = step["prefill_tokens"] + step["decode_tokens"]
        assert len(counts) == moe_layers and all(len(layer) == 8 for layer in counts)
        # top_k = 2: each token fills two slots per MoE layer, warm-up's forwards excluded
        assert [sum(layer) for layer in counts] == [tokens * 2] * moe_layers
    assert any(0 < c < 2 * (s["prefill_tokens"] + s["decode_tokens"])
               for s in steps for layer in s["expert_tokens"] for c in layer)


def test_without_a_trace_the_blocks_count_nothing(tmp_path):
    path = make_tiny_model_dir(tmp_path, arch="mixtral", seed=3)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=128)
    try:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        blocks = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]
        assert blocks and all(b.expert_load is None for b in blocks)
    finally:
        llm.llm_engine.close()
