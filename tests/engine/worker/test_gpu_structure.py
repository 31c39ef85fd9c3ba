"""What the GPU path adds, checked on any host: decode batches padded to CUDA-graph sizes
(run eagerly here, through the real CPU kernels), and the KV pool sized from device
memory. The capture itself and the profiled pool need a GPU (bench/bench_gpu.py)."""
import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.worker.cuda_graphs import DecodeGraphs, capture_sizes
from engine.worker.gpu_memory import kv_pool_bytes
from engine.worker.kv_pool import CPU_KV_CACHE_BYTES, pool_bytes
from engine.llm_engine import LLMEngine
from testing.tiny_model import make_tiny_model_dir

PROMPTS = ["The quick brown fox", "1, 2, 3, 4,", "Paris is the capital of", "def main():",
           "Once upon a time", "A" * 5, "Hello", "The sky is"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("graphs"), arch="llama", seed=5))


def test_capture_sizes_follow_vllm_and_end_at_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, *range(8, 65, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_padded_decode_batches_give_the_same_tokens_and_logprobs(tiny):
    """Every batch size from 8 down to 1 is met as sequences finish at different lengths;
    3, 5, 6 and 7 are padded (slot -1, seq_len 0) up to 4 and 8."""
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=3)
              for i in range(len(PROMPTS))]

    def run(padded: bool):
        llm = LLM(tiny, dtype="float32", num_kv_blocks=128, block_size=8, max_num_seqs=8,
                  max_model_len=256)
        runner = llm.llm_engine.runner
        if padded:
            runner.use_decode_graphs(8, 256, capture=False)
            assert runner.decode_graphs.sizes == [1, 2, 4, 8]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    plain, padded = run(False), run(True)
    for (ids, lps), (ids2, lps2) in zip(plain, padded):
        assert ids == ids2
        for a, b in zip(lps, lps2):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_decode_graph_run_matches_the_model_and_leaves_padding_inert(tiny):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=8,
              max_model_len=128)
    runner = llm.llm_engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 8, 128, 8, runner.device)
    from engine.models import AttentionMetadata

    def batch(seq_lens, tables):
        seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        tables = torch.tensor(tables, dtype=torch.int32)
        positions = (seq_lens - 1).long()
        slots = tables[torch.arange(len(seq_lens)), positions // 8].long() * 8 + positions % 8
        qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
        return positions, AttentionMetadata(slots, tables, qsl, seq_lens, 1, int(seq_lens.max()))

    # first four sequences fill the size-4 buffers; then three of 5, 9 and 17 tokens
    # of context reuse them, and the fourth row is padding over the earlier one's slot
    with torch.inference_mode():
        positions, meta = batch([3, 4, 12, 7], [[6, 0], [7, 0], [8, 9], [10, 0]])
        graphs.run(torch.tensor([1, 2, 3, 4]), positions, meta)
    positions, meta = batch([5, 9, 17], [[0, 0, 0], [1, 2, 0], [3, 4, 5]])
    slots = meta.slot_mapping
    ids = torch.tensor([11, 22, 33])
    before = [k.clone() for k, _ in runner.kv_caches]
    with torch.inference_mode():
        hidden = graphs.run(ids, positions, meta)
        assert hidden.shape[0] == 3 and graphs.padded_size(3) == 4
        after = [k.clone() for k, _ in runner.kv_caches]
        expected = runner.model(ids, positions, runner.kv_caches, meta)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    # the padded fourth row wrote nothing: only the three real slots changed
    for old, new in zip(before, after):
        changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert set(changed) <= set(slots.tolist())
    assert graphs.run(torch.zeros(9, dtype=torch.int64), torch.zeros(9, dtype=torch.int64),
                      meta) is None  # more sequences than the largest size: eager


def test_kv_pool_from_device_memory():
    gib = 1 << 30
    # 0.9 of 80 GiB, less a 20 GiB peak (weights and the profiled step) and 1 GiB of context
    assert kv_pool_bytes(80 * gib, 0.9, 20 * gib, gib) == int(0.9 * 80 * gib) - 21 * gib
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2 .* leaves nothing"):
        kv_pool_bytes(80 * gib, 0.2, 16 * gib, gib)


def test_pool_size_on_cpu_ignores_gpu_memory_utilization(tiny, caplog):
    loaded = LLM(tiny, dtype="float32", num_kv_blocks=16, max_model_len=128).llm_engine.loaded
    config = EngineConfig.from_dict({"device": "cpu", "gpu_memory_utilization": "0.5"})
    with caplog.at_level(logging.INFO, logger="engine.worker.kv_pool"):
        assert pool_bytes(config, loaded) == CPU_KV_CACHE_BYTES
    assert "gpu_memory_utilization ignored: on cpu" in caplog.text
    given = EngineConfig.from_dict({"device": "cpu", "kv_cache_memory_bytes": 1 << 20})
    assert pool_bytes(given, loaded) == 1 << 20
