"""Tensor parallelism on CPU (gloo): the sharding math alone, then whole engines with 2
(or 3) ranks against one rank on the same weights.

Comparison rule: the all-reduces sum each row-parallel layer's partial products in a
different order than one matmul does, so fp32 hidden states differ in the last bits.
Greedy token ids must be identical for the tested prompts; the sampled tokens' logprobs
(the logits, normalised) must agree within 1e-4."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, LoRARequest, SamplingParams
from engine.llm_engine import EngineStepError
from engine.models.layers import Linear
from engine.distributed.sharding import (LogitsGather, RowParallelLinear, VocabParallelEmbedding,
                                      head_shard, vocab_slice)
from testing.lora_adapter import make_lora_adapter_dir
from testing.tiny_model import make_tiny_model_dir

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived a",
           "1, 2, 3, 4,", "Paris is the capital of", "def main():\n    print("]
SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 2
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


# ---- the sharding math, one rank at a time --------------------------------------------
class _OneRankOfMany:
    """Rank `rank` of `world_size` with the collectives left out: the test adds up (or
    concatenates) the ranks' partial results itself, which is what the collectives do."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.is_driver = rank == 0

    def all_reduce(self, tensor):
        return tensor

    def all_gather_columns(self, tensor):
        return tensor


def _linear(in_features, out_features, bias):
    layer = Linear(in_features, out_features, bias, torch.float32)
    gen = torch.Generator().manual_seed(in_features * out_features)
    layer.weight.data = torch.randn(out_features, in_features, generator=gen)
    if bias:
        layer.bias.data = torch.randn(out_features, generator=gen)
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_row_parallel_linear_partials_sum_to_the_full_layer(bias):
    full = _linear(32, 12, bias)
    x = torch.randn(5, 32)
    world = 4
    partials = [RowParallelLinear(full, r * 8, (r + 1) * 8, _OneRankOfMany(r, world))(
        x[:, r * 8:(r + 1) * 8]) for r in range(world)]
    torch.testing.assert_close(sum(partials), full(x), atol=1e-5, rtol=1e-5)


def test_vocab_parallel_embedding_and_logits_rebuild_the_full_tables():
    vocab, hidden, world = 11, 6, 3  # 11 rows over 3 ranks: 4 + 4 + 3, the last padded
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 3, 4, 7, 8, 10, 10, 1])
    rows, logit_blocks = [], []
    x = torch.randn(2, hidden)
    for rank in range(world):
        start, end, per_rank = vocab_slice(vocab, world, rank)
        group = _OneRankOfMany(rank, world)
        rows.append(VocabParallelEmbedding(table[start:end], start, end, group)(ids))
        block = torch.zeros(2, per_rank)
        block[:, :end - start] = x @ table[start:end].T
        logit_blocks.append(block)
    assert torch.equal(sum(rows), F.embedding(ids, table))  # exact: one non-zero term each
    gathered = LogitsGather(_OneRankOfMany(0, world), vocab)(torch.cat(logit_blocks, dim=-1))
    torch.testing.assert_close(gathered, x @ table.T)


def test_head_shards_split_or_replicate_kv_heads_so_each_rank_reads_its_own():
    # GQA 8 q heads over 4 KV heads: q head h reads KV head h // 2.
    for world in (1, 2, 4, 8):
        covered = []
        for rank in range(world):
            shard = head_shard(8, 4, world, rank)
            q_heads = range(shard.q_start, shard.q_start + shard.num_heads)
            kv_heads = range(shard.kv_start, shard.kv_start + shard.num_kv_heads)
            assert all(h // 2 in kv_heads for h in q_heads)
            covered.extend(q_heads)
        assert covered == list(range(8))
    assert head_shard(8, 4, 8, 5).num_kv_heads == 1  # replicated past 4 ranks


@pytest.mark.parametrize("heads,kv_heads,world,fragment", [
    (9, 3, 2, "num_attention_heads"), (8, 4, 3, "num_attention_heads"),
    (12, 6, 4, "num_key_value_heads"), (8, 3, 8, "num_key_value_heads")])
def test_head_shard_refuses_uneven_splits(heads, kv_heads, world, fragment):
    with pytest.raises(ValueError, match=fragment):
        head_shard(heads, kv_heads, world, 0)


# ---- whole engines ------------------------------------------------------------------------
def _generate(llm, prompts, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    ids = [o.outputs[0].token_ids for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outs]
    return ids, logprobs


def _assert_same_greedy(reference, candidate):
    ref_ids, ref_lp = reference
    ids, lp = candidate
    assert ids == ref_ids
    torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref_lp), atol=1e-4, rtol=0)


def _stressed_args():
    # Few blocks: requests get preempted and recomputed; the shared system prompt gives
    # prefix-cache hits; the small budget chunks the prefills.
    return dict(block_size=4, num_kv_blocks=48, max_model_len=160, max_num_batched_tokens=32,
                long_prefill_token_threshold=9, max_num_seqs=8)


def _stressed_prompts():
    return [SYSTEM + p for p in PROMPTS] + PROMPTS


def _check_stressed(tp_llm, reference):
    _assert_same_greedy(reference, _generate(tp_llm, _stressed_prompts()))
    stats = tp_llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits > 0


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory):
    """Llama, 4 q heads over 2 KV heads, separate lm_head: 2 ranks split the KV heads."""
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("gqa"), arch="llama", seed=3))


@pytest.fixture(scope="module")
def tiny_one_kv_head(tmp_path_factory):
    """Qwen2 (qkv bias, tied embeddings), 1 KV head (2 ranks replicate it) and an odd
    vocabulary (the last rank's vocab block is padded)."""
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("kv1"), arch="qwen2", seed=5,
                                   num_key_value_heads=1, vocab_size=49155))


def test_two_ranks_match_one_rank_with_gqa_preemption_and_prefix_hits(tiny_gqa):
    reference = _generate(LLM(tiny_gqa, dtype="float32", num_kv_blocks=512, max_model_len=160,
                              enable_prefix_caching=False), _stressed_prompts())
    tp = LLM(tiny_gqa, dtype="float32", tensor_parallel_size=2, **_stressed_args())
    try:
        engine = tp.llm_engine
        assert engine.loaded.num_kv_heads == 1 and engine.loaded.num_heads == 2
        assert engine.runner.kv_caches[0][0].shape[2] == 1  # this rank's KV heads only
        _check_stressed(tp, reference)
        workers = engine._tensor_parallel.workers
        assert all(p.is_alive() for p in workers)
    finally:
        tp.llm_engine.close()
    assert not any(p.is_alive() for p in workers)  # close() stopped them
    assert {p.exitcode for p in workers} == {0}  # on rank 0's "stop", not by a signal


@pytest.fixture(scope="module")
def tiny_windowed(tmp_path_factory):
    """Mistral with a sliding window of 8: every rank frees the blocks behind it."""
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("sw"), arch="mistral", seed=3,
                                   sliding_window=8))


# The pool: a window holds a few blocks per request (at most 11 here), a full group all
# of max_model_len's 40; pools this small still preempt.
@pytest.mark.parametrize("windows,num_blocks", [((8, 8), 16), ((8, None), 52)],
                         ids=["one_group", "two_groups"])
def test_two_ranks_match_one_rank_with_sliding_windows(tiny_windowed, windows, num_blocks,
                                                       monkeypatch):
    """The model's layout (one windowed group); then layer 0 windowed, layer 1 in a full group
    (which keeps more than its window reads): rank 0's layout reaches the workers, and
    each step's metadata goes to them one per group."""
    reference = _generate(LLM(tiny_windowed, dtype="float32", num_kv_blocks=512,
                              max_model_len=160, enable_prefix_caching=False),
                          _stressed_prompts())
    from engine import startup
    from engine.core.kv_cache import build_layout
    monkeypatch.setattr(startup, "kv_layout", lambda loaded: build_layout(list(windows)))
    tp = LLM(tiny_windowed, dtype="float32", tensor_parallel_size=2,
             **{**_stressed_args(), "num_kv_blocks": num_blocks})
    try:
        assert tp.llm_engine.scheduler.kv_cache_manager.layout.layer_windows == windows
        _check_stressed(tp, reference)
    finally:
        tp.llm_engine.close()


def test_replicated_kv_head_tied_padded_vocab_then_a_killed_worker(tiny_one_kv_head):
    reference = _generate(LLM(tiny_one_kv_head, dtype="float32", num_kv_blocks=256,
                              max_model_len=160), PROMPTS)
    tp = LLM(tiny_one_kv_head, dtype="float32", tensor_parallel_size=2, num_kv_blocks=256,
             max_model_len=160)
    engine = tp.llm_engine
    try:
        _assert_same_greedy(reference, _generate(tp, PROMPTS))
        # Mid-run: a few steps in, the worker is killed; the next step must fail with the
        # worker named, promptly, whether the liveness check or a collective sees it first.
        engine.add_request("a", PROMPTS[0], GREEDY)
        engine.add_request("b", PROMPTS[1], GREEDY)
        for _ in range(3):
            engine.step()
        worker = engine._tensor_parallel.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineStepError, match=r"tensor-parallel worker died: tle-tp-rank1") \
                as failure:
            for _ in range(50):
                engine.step()
        assert failure.value.fatal  # the backend's loop ends on it (health check: unload)
        assert time.monotonic() - started < 10
        assert not engine.has_unfinished_requests()  # the step's requests were aborted
        engine.add_request("c", PROMPTS[2], GREEDY)  # later steps keep failing, at once
        with pytest.raises(EngineStepError, match="must be restarted"):
            engine.step()
    finally:
        engine.close()
    assert not worker.is_alive()


def test_batch_invariant_two_ranks_alone_equal_crowded_with_an_adapter(tiny_gqa, tmp_path):
    """batch_invariant at TP 2: every rank's kernels are the mode's and the all-reduce adds
    the ranks in rank order, so a request's tokens and logprobs are the same bits alone
    and in a chunked, prefix-cached crowd of base and adapter rows."""
    adapter = LoRARequest("a", 1, str(make_lora_adapter_dir(tiny_gqa, tmp_path / "a", seed=1)))
    tp = LLM(tiny_gqa, dtype="float32", tensor_parallel_size=2, batch_invariant=True,
             enable_lora=True, max_loras=1, max_lora_rank=8, block_size=8, num_kv_blocks=96,
             max_model_len=160, max_num_batched_tokens=24, long_prefill_token_threshold=7,
             max_num_seqs=8)
    try:
        assert tp.llm_engine._tensor_parallel.group.fixed_sum_order
        prompts = [SYSTEM + p for p in PROMPTS[:3]] + PROMPTS[3:]
        loras = [adapter if i % 2 else None for i in range(len(prompts))]

        def results(outs):
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs,
                     o.outputs[0].cumulative_logprob) for o in outs]

        alone = [results(tp.generate([p], GREEDY, use_tqdm=False, lora_request=lora))[0]
                 for p, lora in zip(prompts, loras)]
        crowded = tp.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert results(crowded) == alone
        assert tp.llm_engine.get_stats().prefix_cache_hits > 0
    finally:
        tp.llm_engine.close()


@pytest.fixture(scope="module")
def tiny_three_kv_heads(tmp_path_factory):
    """Llama, 6 q heads over 3 KV heads: 3 ranks hold one KV head each."""
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("kv3"), arch="llama", seed=11,
                                   hidden_size=96, intermediate_size=192,
                                   num_attention_heads=6, num_key_value_heads=3))


def test_batch_invariant_three_ranks_alone_equal_crowded(tiny_three_kv_heads):
    """batch_invariant at TP 3, where the order of the ranks' adds shows in the bits
    (test_fixed_sum_order.py): a request's tokens and logprobs are the same alone and in a
    chunked, prefix-cached crowd."""
    tp = LLM(tiny_three_kv_heads, dtype="float32", tensor_parallel_size=3,
             batch_invariant=True, block_size=8, num_kv_blocks=96, max_model_len=160,
             max_num_batched_tokens=24, long_prefill_token_threshold=7, max_num_seqs=8)
    try:
        engine = tp.llm_engine
        assert engine._tensor_parallel.group.fixed_sum_order
        assert engine.loaded.num_kv_heads == 1 and engine.loaded.num_heads == 2
        prompts = [SYSTEM + p for p in PROMPTS[:3]] + PROMPTS[3:]

        def results(outs):
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs,
                     o.outputs[0].cumulative_logprob) for o in outs]

        alone = [results(tp.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
        crowded = tp.generate(prompts, GREEDY, use_tqdm=False)
        assert results(crowded) == alone
        assert engine.get_stats().prefix_cache_hits > 0
    finally:
        tp.llm_engine.close()


def test_bad_tensor_parallel_size_is_refused_before_any_worker_starts(tiny_gqa):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 must divide .*num_attention_heads \(4\)"):
        LLM(tiny_gqa, dtype="float32", tensor_parallel_size=3, num_kv_blocks=64, max_model_len=64)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(tiny_gqa, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="quantization 'gguf' runs in one process only"):
        LLM(None, quantization="gguf", tensor_parallel_size=2)


@pytest.mark.slow
def test_smollm2_three_ranks_match_one_rank():
    """The real default model (9 heads over 3 KV heads, so N = 2 is refused and N = 3
    gives each rank one KV head), fp32, under preemption and prefix hits."""
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\)"):
        LLM(None, dtype="float32", tensor_parallel_size=2, max_model_len=160)
    single = LLM(None, dtype="float32", num_kv_blocks=512, max_model_len=160,
                 enable_prefix_caching=False)
    reference = _generate(single, _stressed_prompts())
    del single
    tp = LLM(None, dtype="float32", tensor_parallel_size=3, **_stressed_args())
    try:
        _check_stressed(tp, reference)
    finally:
        tp.llm_engine.close()


def test_triton_model_json_and_config_pbtxt_carry_tensor_parallel_size():
    """The Triton model builds its engine from split_parameters' EngineConfig, so this is
    the whole of its path (KIND_MODEL in model_repository/llm/config.pbtxt)."""
    from backend.config_params import split_parameters
    from backend.model_json import parse_model_json

    config, _ = split_parameters({}, parse_model_json({"tensor_parallel_size": 2}))
    assert config.tensor_parallel_size == 2
    config, _ = split_parameters({"tensor_parallel_size": "3"},
                                 parse_model_json({"tensor_parallel_size": 2}))
    assert config.tensor_parallel_size == 3  # config.pbtxt wins, as for every argument
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        split_parameters({}, parse_model_json({"tensor_parallel_size": "two"}))
