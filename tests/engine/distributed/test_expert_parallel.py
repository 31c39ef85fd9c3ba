"""Expert parallelism (enable_expert_parallel; engine/distributed/sharding.py): each rank
keeps whole experts, a contiguous range, and maps the router's global ids to its own, -1
for the others'. First the placement and one block's partial outputs, then the refusals,
then whole engines with 2 ranks against one (test_tensor_parallel.py's comparison rule:
same greedy tokens, logprobs within 1e-4, since the all-reduce adds the ranks' shares in
another order than one rank's slots)."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.distributed.sharding import (_place_experts, check_shardable, expert_parallel_applies,
                                         expert_range)
from engine.models.moe import FusedMoE
from testing.tiny_model import make_tiny_model_dir, tiny_config
from tests.engine.distributed.test_tensor_parallel import (PROMPTS, SYSTEM, _OneRankOfMany,
                                                           _check_stressed, _generate,
                                                           _stressed_args, _stressed_prompts)
from tests.engine.distributed.test_tensor_parallel_moe import _block

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world, ranges", [
    (2, [(0, 4), (4, 8)]),
    # vLLM's linear placement: 8 // 3 = 2 each, the 8 % 3 = 2 left over to ranks 0 and 1.
    (3, [(0, 3), (3, 6), (6, 8)]),
])
def test_linear_placement_of_eight_experts(world, ranges):
    assert [expert_range(8, world, rank) for rank in range(world)] == ranges


@pytest.mark.parametrize("bias", [False, True])
def test_ranks_partial_outputs_sum_to_the_full_block(bias):
    """4 experts over 3 ranks (2, 1, 1): every rank routes every token with the whole
    router and computes its experts' slots only; the shares add up to the unsharded
    block's output, each expert's biases counted once, by the rank that holds it."""
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full_block = _block(bias)
        full = full_block(x)
        partials = []
        for rank, (start, end) in enumerate([(0, 2), (2, 3), (3, 4)]):
            moe = _block(bias)
            _place_experts(moe, _OneRankOfMany(rank, 3))
            assert moe.w13.shape == (end - start, 24, 16) and moe.w2.shape == (end - start, 16, 12)
            assert moe.num_experts == 4 and moe.gate.weight.shape[0] == 4  # the router is whole
            torch.testing.assert_close(moe.w2, full_block.w2[start:end], rtol=0, atol=0)
            if bias:
                torch.testing.assert_close(moe.w2_bias, full_block.w2_bias[start:end],
                                           rtol=0, atol=0)
            expected_map = [-1] * 4
            expected_map[start:end] = range(end - start)
            assert moe.expert_map.tolist() == expected_map
            partials.append(moe(x))
            # a token none of whose experts this rank holds gets nothing from it
            _, ids = torch.topk(moe.gate(x), 2, dim=-1)
            elsewhere = ~((ids >= start) & (ids < end)).any(dim=-1)
            assert bool(elsewhere.any()) and not bool(partials[-1][elsewhere].any())
    torch.testing.assert_close(sum(partials), full, atol=1e-5, rtol=1e-5)


def test_bad_combinations_are_refused_or_ignored_by_name(caplog):
    mixtral = tiny_config("mixtral")  # 8 experts
    assert expert_parallel_applies(mixtral, 8, True)
    assert not expert_parallel_applies(mixtral, 2, False)
    assert not expert_parallel_applies(mixtral, 1, True)  # one rank holds them all anyway
    with pytest.raises(ValueError, match=r"enable_expert_parallel: tensor_parallel_size 16 "
                                         r"is larger than the model's 8 experts"):
        expert_parallel_applies(mixtral, 16, True)
    with caplog.at_level(logging.INFO, logger="engine.distributed.sharding"):
        assert not expert_parallel_applies(tiny_config("llama"), 2, True)
    assert "enable_expert_parallel: the model has no experts; ignored" in caplog.text


def test_whole_experts_lift_the_intermediate_size_split():
    """Experts are not cut, so their intermediate size need not divide N; a dense
    layer's still must (Qwen3-MoE's layer 1)."""
    mixtral = tiny_config("mixtral", intermediate_size=30)
    with pytest.raises(ValueError, match=r"intermediate_size \(30\)"):
        check_shardable(mixtral, 4)
    check_shardable(mixtral, 4, expert_parallel=True)
    qwen = tiny_config("qwen3-moe", moe_intermediate_size=30)
    check_shardable(qwen, 4, expert_parallel=True)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(30\)"):
        check_shardable(qwen, 4)
    with pytest.raises(ValueError, match=r"intermediate_size \(30\)"):
        check_shardable(tiny_config("qwen3-moe", intermediate_size=30), 4, expert_parallel=True)


@pytest.fixture(scope="module", params=["mixtral", "qwen3-moe", "gpt-oss"])
def tiny_moe(request, tmp_path_factory):
    # qwen3-moe: an MoE layer and a dense one (tensor-parallel as ever); gpt-oss: expert
    # biases, attention sinks and alternating windows.
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), arch=request.param, seed=3)
    # As in test_tensor_parallel_moe.py: gpt-oss's three KV groups need more blocks.
    return str(path), 72 if request.param == "gpt-oss" else _stressed_args()["num_kv_blocks"]


def test_two_ranks_match_one_rank_with_preemption_and_prefix_hits(tiny_moe, tmp_path):
    path, num_blocks = tiny_moe
    reference = _generate(LLM(path, dtype="float32", num_kv_blocks=512, max_model_len=160,
                              enable_prefix_caching=False), _stressed_prompts())
    trace = tmp_path / "trace.jsonl"
    ep = LLM(path, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True,
             trace_path=str(trace), **{**_stressed_args(), "num_kv_blocks": num_blocks})
    try:
        assert ep.llm_engine._tensor_parallel.expert_parallel
        layers = ep.llm_engine.loaded.model.model.layers
        blocks = [layer.mlp for layer in layers if isinstance(layer.mlp, FusedMoE)]
        # rank 0 holds experts 0-3 whole (intermediate 32, not TP's 16)
        assert blocks and all(b.w13.shape[:2] == (4, 64) and b.intermediate_size == 32
                              and b.expert_map.tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
                              and b.reduce_group is not None for b in blocks)
        _check_stressed(ep, reference)
    finally:
        ep.llm_engine.close()
    # Rank 0 counts the router's global ids, before they are mapped to its own experts:
    # every expert's slots, its own and rank 1's (top_k 2).
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if r["type"] == "step"]
    assert steps and all([sum(layer) for layer in s["expert_tokens"]]
                         == [2 * (s["prefill_tokens"] + s["decode_tokens"])] * len(blocks)
                         for s in steps)
    assert any(sum(layer[4:]) for s in steps for layer in s["expert_tokens"])


def test_batch_invariant_expert_parallel_alone_equals_crowded(tmp_path):
    """The group adds the ranks' shares in rank order in this mode, as under plain TP,
    and each rank's experts run the mode's kernels: a request's tokens and logprobs are
    the same bits alone and in a chunked, prefix-cached crowd (bf16, where a changed
    order or blocking shows)."""
    path = str(make_tiny_model_dir(tmp_path, arch="mixtral", seed=3))
    ep = LLM(path, dtype="bfloat16", tensor_parallel_size=2, enable_expert_parallel=True,
             batch_invariant=True, block_size=8, num_kv_blocks=96, max_model_len=160,
             max_num_batched_tokens=24, long_prefill_token_threshold=7, max_num_seqs=8)
    try:
        assert ep.llm_engine._tensor_parallel.group.fixed_sum_order
        prompts = [SYSTEM + p for p in PROMPTS[:3]] + PROMPTS[3:]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)

        def results(outs):
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

        alone = [results(ep.generate([p], params, use_tqdm=False))[0] for p in prompts]
        assert results(ep.generate(prompts, params, use_tqdm=False)) == alone
        assert ep.llm_engine.get_stats().prefix_cache_hits > 0
    finally:
        ep.llm_engine.close()


def test_triton_model_json_and_config_pbtxt_carry_enable_expert_parallel():
    from backend.config_params import split_parameters
    from backend.model_json import parse_model_json

    config, _ = split_parameters({}, parse_model_json({"tensor_parallel_size": 2,
                                                       "enable_expert_parallel": True}))
    assert config.tensor_parallel_size == 2 and config.enable_expert_parallel
    config, _ = split_parameters({"enable_expert_parallel": "false"},
                                 parse_model_json({"enable_expert_parallel": True}))
    assert not config.enable_expert_parallel  # config.pbtxt wins, as for every argument
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        split_parameters({"enable_expert_parallel": "maybe"}, None)
