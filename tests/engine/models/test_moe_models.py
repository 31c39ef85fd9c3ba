"""The mixture-of-experts families (Mixtral, Qwen3-MoE) on tiny random HF models against
HF transformers' eager float32: first the pieces (the routing rules and kernels/torch_moe.py's
op against HF's own MoE blocks, the dispatch door against the op, the loader), then logits
through the paged cache in mixed prefill / chunked / decode batches, then greedy tokens
and logprobs through the whole engine, alone and under chunked prefill, prefix-cache hits
and preemption."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from engine.models import load_model
from engine.models.moe import FusedMoE, Routing, route
from kernels import dispatch, torch_moe
from kernels.dispatch import ExpertWeights
from kernels.dispatch import moe as moe_dispatch
from testing.hf_reference import hf_causal_lm
from testing.model_batch import PagedBatchBuilder, check_mixed_batches_match_hf, run_chunks
from testing.tiny_model import make_tiny_model_dir, tiny_config
from tests.engine.models.test_families import (ENGINE_PROMPTS, assert_same_greedy,
                                               engine_greedy, hf_greedy)

pytestmark = pytest.mark.timeout(600)

# Test name -> (tiny_model arch, config overrides).
FAMILIES = {
    "mixtral": ("mixtral", {}),
    # Layer 0 MoE, layer 1 dense; weights unnormalised.
    "qwen3-moe": ("qwen3-moe", {}),
    # decoder_sparse_step picks the MoE layers instead (layer 0 dense, 1 MoE); weights
    # renormalised, as the real Qwen3-30B-A3B's.
    "qwen3-moe-norm": ("qwen3-moe", dict(norm_topk_prob=True, decoder_sparse_step=2,
                                         mlp_only_layers=[])),
}
MOE_LAYERS = {"mixtral": [0, 1], "qwen3-moe": [0], "qwen3-moe-norm": [1]}


# ---- the op and the routing rules against HF's own blocks -----------------------------
def _hf_block(arch: str, seed: int, **overrides):
    """HF's sparse MoE block of the tiny config, weights N(0, 1) so the experts' outputs
    and the router's choices are far from ties."""
    import transformers as tf
    config = tiny_config(arch, **overrides)
    block_cls = {"mixtral": tf.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock,
                 "qwen3-moe": tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock}[arch]
    block = block_cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return config, block


def _stacked(block, arch: str) -> ExpertWeights:
    """HF's per-expert weights as the op's stacks: w13 [E, 2I, H] gate then up, w2 [E, H, I]."""
    gate, up, down = {"mixtral": ("w1", "w3", "w2"),
                      "qwen3-moe": ("gate_proj", "up_proj", "down_proj")}[arch]
    experts = block.experts
    w13 = torch.stack([torch.cat([getattr(e, gate).weight, getattr(e, up).weight])
                       for e in experts])
    w2 = torch.stack([getattr(e, down).weight for e in experts])
    return ExpertWeights(w13.detach(), w2.detach())


@pytest.mark.parametrize("arch,overrides,rule", [
    ("mixtral", {}, Routing.SOFTMAX_TOPK_RENORM),
    ("qwen3-moe", dict(norm_topk_prob=False), Routing.SOFTMAX_TOPK),
    ("qwen3-moe", dict(norm_topk_prob=True), Routing.SOFTMAX_TOPK_RENORM)])
@pytest.mark.parametrize("num_tokens", [2, 37])
def test_torch_moe_and_routing_match_hf_blocks(arch, overrides, rule, num_tokens):
    """Our routing of HF's router logits, then kernels/torch_moe.py's op, give HF's block
    output; with 2 tokens at most 4 of the 8 experts get one, so the op must skip the
    idle ones. Float32: only the order of the per-token sums differs."""
    config, block = _hf_block(arch, seed=num_tokens, **overrides)
    x = torch.randn(1, num_tokens, config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected, router_logits = block(x)
    weights, ids = route(router_logits, config.num_experts_per_tok, rule)
    if num_tokens == 2:
        assert len(torch.unique(ids)) < block.num_experts
    experts = _stacked(block, arch)
    got = torch_moe.fused_moe(x[0], experts.w13, experts.w2, weights, ids, "silu")
    torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=1e-5)
    # The renormalised rule's weights sum to 1; the other's to less.
    sums = weights.sum(-1)
    if rule is Routing.SOFTMAX_TOPK_RENORM:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    else:
        assert (sums < 1 - 1e-3).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_module_matches_hf_block(dtype):
    """FusedMoE with HF's weights placed by its own expert_slice (as the loader does): the
    router GEMM, the rule and the op together. bf16: HF rounds each expert's weighted
    output and sums in bf16, ours sums in float32 and rounds once."""
    config, block = _hf_block("mixtral", seed=9)
    moe = FusedMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                   config.num_experts_per_tok, Routing.SOFTMAX_TOPK_RENORM, dtype)
    with torch.no_grad():
        moe.gate.weight.copy_(block.gate.weight)
        for e, expert in enumerate(block.experts):
            for hf_name, part in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
                moe.expert_slice(e, part).copy_(getattr(expert, hf_name).weight)
        block.to(dtype)
    x = torch.randn(19, config.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        expected, _ = block(x[None])
        got = moe(x)
    assert got.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(got, expected[0], **tol)


def test_topk_softmax_rule_matches_gpt_oss_router():
    """gpt-oss's rule (top-k of the biased logits, softmax over those k), against HF's
    GptOssTopKRouter: same experts, same weights."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    config = GptOssConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=4)
    router = GptOssTopKRouter(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.bias.copy_(torch.randn(router.bias.shape, generator=gen))
    x = torch.randn(11, 32, generator=gen)
    with torch.no_grad():
        scores, hf_ids = router(x)
    logits = torch.nn.functional.linear(x, router.weight, router.bias)
    weights, ids = route(logits, 4, Routing.TOPK_SOFTMAX)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(torch.zeros_like(scores).scatter_(1, ids, weights), scores)


# ---- the dispatch door -----------------------------------------------------------------
def _random_op_inputs(dtype, num_tokens=13, num_experts=6, hidden=32, inter=24, top_k=2):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    experts = ExpertWeights((torch.randn(num_experts, 2 * inter, hidden, generator=gen)
                             * hidden ** -0.5).to(dtype),
                            (torch.randn(num_experts, hidden, inter, generator=gen)
                             * inter ** -0.5).to(dtype))
    weights, ids = route(torch.randn(num_tokens, num_experts, generator=gen), top_k,
                         Routing.SOFTMAX_TOPK_RENORM)
    ids[3, 1] = -1  # an expert another expert-parallel rank holds: contributes nothing
    return x, experts, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_door_computes_the_torch_definition(dtype):
    """Whichever kernel the door picks on this host (the native one where kernels/cpu/moe.py
    exists and takes the call): the definition's result, up to summation order."""
    x, experts, weights, ids = _random_op_inputs(dtype)
    got = dispatch.fused_moe(x, experts, weights, ids, "silu")
    expected = torch_moe.fused_moe(x, experts.w13, experts.w2, weights, ids, "silu")
    assert got.dtype == dtype and got.shape == x.shape
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, expected, **tol)


def test_dispatch_door_without_a_native_kernel_is_the_torch_definition(monkeypatch):
    monkeypatch.setattr(moe_dispatch, "native_cpu_kernel", lambda: None)
    x, experts, weights, ids = _random_op_inputs(torch.float32)
    got = dispatch.fused_moe(x, experts, weights, ids, "silu")
    assert torch.equal(got, torch_moe.fused_moe(x, experts.w13, experts.w2, weights, ids, "silu"))


def test_dispatch_door_takes_the_native_result_and_falls_back_when_it_declines(monkeypatch):
    calls = []

    def native(x, w13, w2, topk_weights, topk_ids, activation, **options):
        calls.append((w13, w2, activation, options))
        return answer

    monkeypatch.setattr(moe_dispatch, "native_cpu_kernel", lambda: native)
    x, experts, weights, ids = _random_op_inputs(torch.float32)
    answer = torch.full_like(x, 3.0)
    assert dispatch.fused_moe(x, experts, weights, ids, "silu") is answer
    w13, w2, activation, options = calls[0]
    assert w13 is experts.w13 and w2 is experts.w2 and activation == "silu"
    assert options == dict(w13_bias=None, w2_bias=None, alpha=1.702, limit=7.0)
    answer = None  # declined: the torch definition answers
    got = dispatch.fused_moe(x, experts, weights, ids, "silu")
    assert len(calls) == 2
    assert torch.equal(got, torch_moe.fused_moe(x, experts.w13, experts.w2, weights, ids, "silu"))


def test_native_kernel_is_looked_up_only_where_its_module_exists(monkeypatch):
    """kernels/cpu/moe.py is optional (another change adds it): where find_spec finds no
    such module the door has no native kernel and imports nothing; where it does, its
    fused_moe_cpu is the one."""
    lookup = moe_dispatch.native_cpu_kernel.__wrapped__  # uncached
    monkeypatch.setattr(moe_dispatch.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setitem(sys.modules, "kernels.cpu.moe", None)  # an import would raise
    assert lookup() is None
    monkeypatch.undo()
    fake = types.ModuleType("kernels.cpu.moe")
    fake.fused_moe_cpu = lambda *args, **kwargs: None
    fake.__spec__ = object()  # find_spec returns a loaded module's spec
    monkeypatch.setitem(sys.modules, "kernels.cpu.moe", fake)
    assert lookup() is fake.fused_moe_cpu


# ---- models -----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), arch=arch, seed=3,
                               **overrides)
    hf = hf_causal_lm(path, torch.float32, attn_implementation="eager")
    return request.param, path, load_model(path, torch.float32), hf


def test_layers_are_moe_where_hf_puts_experts(family):
    name, _, loaded, hf = family
    ours = [i for i, layer in enumerate(loaded.model.model.layers)
            if isinstance(layer.mlp, FusedMoE)]
    # HF's Mixtral names its block block_sparse_moe, Qwen3-MoE's mlp.
    theirs = [i for i, layer in enumerate(hf.model.layers)
              if any("SparseMoe" in type(m).__name__ for m in layer.children())]
    assert ours == theirs == MOE_LAYERS[name]


def test_mixed_batches_match_hf(family):
    _, _, loaded, hf = family
    check_mixed_batches_match_hf(loaded, hf)


def test_missing_expert_tensor_is_refused_by_name(family):
    from engine.models.loader import iter_checkpoint_tensors
    name, path, loaded, _ = family
    layer = MOE_LAYERS[name][0]
    dropped = {"mixtral": f"model.layers.{layer}.block_sparse_moe.experts.5.w3.weight"}.get(
        name, f"model.layers.{layer}.mlp.experts.5.up_proj.weight")
    net = type(loaded.model)(loaded.hf_config, torch.float32)
    tensors = [(n, t) for n, t in iter_checkpoint_tensors(path) if n != dropped]
    assert len(tensors) == len(list(iter_checkpoint_tensors(path))) - 1
    with pytest.raises(ValueError, match=rf"lacks 1 expert tensors, e.g. \['model.layers.{layer}"
                                         rf"\.mlp\.experts\.5\.up'\]"):
        net.load_weights(tensors)


def test_bf16_tracks_hf_bf16(family):
    """As the dense families' test (test_families.py): equally valid roundings; a token
    whose top-k experts are near a tie may route differently in bf16, so most, not all,
    argmaxes agree."""
    _, path, _, _ = family
    loaded = load_model(path, torch.bfloat16)
    hf = hf_causal_lm(path, torch.bfloat16, attn_implementation="eager")
    toks = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(13)).tolist()
    builder = PagedBatchBuilder(block_size=4, num_blocks=16)
    kv = builder.new_kv_caches(loaded, torch.bfloat16)
    logits = run_chunks(loaded, kv, builder, [("S", toks, 0)])
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([toks]), use_cache=False).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=0.15, rtol=0.05)
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_engine_greedy_matches_hf_alone_and_under_chunking_prefix_hits_and_preemption(family):
    from engine import LLM
    name, path, _, hf = family
    # Alone: one prompt, whole prefill in one step, decodes one row at a time.
    alone = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=128, max_model_len=150)
    ids = [alone.get_tokenizer().encode(p) for p in ENGINE_PROMPTS]
    reference = hf_greedy(hf, ids)
    assert_same_greedy(engine_greedy(alone, ids[2:3]), reference[2:3], f"{name} alone")
    # Small KV pool and step budget: prompts prefill in chunks, sequences get preempted
    # and recomputed, and repeated prefixes come from the cache.
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=150,
              max_num_batched_tokens=16, long_prefill_token_threshold=7, max_num_seqs=8)
    assert_same_greedy(engine_greedy(llm, ids), reference, name)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("family", ["mixtral"], indirect=True)
def test_lora_is_refused_by_name(family):
    """LoRA wraps dense projections by name (engine/models/lora_linear.py); experts are not
    among them, so the engine says so before setting adapters up."""
    from engine import LLM
    _, path, _, _ = family
    with pytest.raises(ValueError, match="takes no LoRA adapters"):
        LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=64, enable_lora=True)
