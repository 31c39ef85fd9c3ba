"""Tensor parallelism for the mixture-of-experts families (engine/distributed/sharding.py,
engine/models/moe.py): each rank keeps a slice of every expert's intermediate columns and
the whole router; first the sharding math on one block, then whole engines with 2 ranks
against one on the same weights (test_tensor_parallel.py's comparison rule: same greedy
tokens, logprobs within 1e-4, since the all-reduce sums in another order)."""
from __future__ import annotations

import pytest
import torch

from engine.distributed.sharding import _shard_experts, check_shardable
from engine.models.moe import FusedMoE, Routing
from testing.tiny_model import make_tiny_model_dir, tiny_config
from tests.engine.distributed.test_tensor_parallel import (_OneRankOfMany, _check_stressed,
                                                           _generate, _stressed_args,
                                                           _stressed_prompts)

pytestmark = pytest.mark.timeout(300)


def _block(bias: bool) -> FusedMoE:
    moe = FusedMoE(16, 12, 4, 2, Routing.SOFTMAX_TOPK_RENORM, torch.float32, expert_bias=bias)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return moe


@pytest.mark.parametrize("bias", [False, True])
def test_ranks_partial_expert_outputs_sum_to_the_full_block(bias):
    """3 ranks of 4 intermediate columns each: every rank routes alike (the router is
    whole), and their partial outputs add up to the unsharded block's (biases once)."""
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = _block(bias)(x)
        partials = []
        for rank in range(3):
            moe = _block(bias)
            _shard_experts(moe, _OneRankOfMany(rank, 3))
            assert moe.w13.shape == (4, 8, 16) and moe.w2.shape == (4, 16, 4)
            assert moe.intermediate_size == 4
            assert (moe.w2_bias is not None) == (bias and rank == 0)
            partials.append(moe(x))
    torch.testing.assert_close(sum(partials), full, atol=1e-5, rtol=1e-5)


def test_moe_intermediate_size_must_split_evenly():
    config = tiny_config("qwen3-moe", moe_intermediate_size=30)
    check_shardable(config, 2)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(30\)"):
        check_shardable(config, 4)


@pytest.fixture(scope="module", params=["mixtral", "qwen3-moe", "gpt-oss"])
def tiny_moe(request, tmp_path_factory):
    # qwen3-moe: an MoE layer and a dense one, each sharded its own way; gpt-oss: expert
    # biases, attention sinks per query head and alternating windows.
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), arch=request.param, seed=3)
    # gpt-oss's three KV groups (two windowed layers, one full) hold up to 64 blocks for one
    # request of max_model_len; 72 still preempts.
    return str(path), 72 if request.param == "gpt-oss" else _stressed_args()["num_kv_blocks"]


def test_two_ranks_match_one_rank_with_preemption_and_prefix_hits(tiny_moe):
    from engine import LLM
    path, num_blocks = tiny_moe
    reference = _generate(LLM(path, dtype="float32", num_kv_blocks=512, max_model_len=160,
                              enable_prefix_caching=False), _stressed_prompts())
    tp = LLM(path, dtype="float32", tensor_parallel_size=2,
             **{**_stressed_args(), "num_kv_blocks": num_blocks})
    try:
        layers = tp.llm_engine.loaded.model.model.layers
        blocks = [layer.mlp for layer in layers if isinstance(layer.mlp, FusedMoE)]
        assert blocks and all(b.reduce_group is not None and b.intermediate_size == 16
                              for b in blocks)
        _check_stressed(tp, reference)
    finally:
        tp.llm_engine.close()
