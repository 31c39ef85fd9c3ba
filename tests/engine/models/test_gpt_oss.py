"""gpt-oss (engine/models/gpt_oss.py) on a tiny random HF model against HF transformers'
eager float32: the MoE block against HF's GptOssMLP (interleaved, transposed experts,
biases, the clamped SwiGLU, top-k-then-softmax routing), the loader's refusals, logits
through the paged cache in mixed steps (one block table, and the KV manager's groups of
windowed and full layers), then greedy tokens and logprobs through the whole engine for
prompts past the window: alone, batched under chunked prefill, prefix-cache hits and
preemption. The tiny model's sinks are drawn at the logits' scale
(testing/tiny_model.py), and a test shows the comparisons see them."""
from __future__ import annotations

import pytest
import torch

from engine.models import load_model
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.loader import iter_checkpoint_tensors
from engine.models.moe import FusedMoE
from testing.hf_reference import hf_causal_lm
from testing.model_batch import check_mixed_batches_match_hf, last_logits
from testing.tiny_model import make_tiny_model_dir, tiny_config
from tests.engine.models.test_families import (ENGINE_PROMPTS, _check_mixed_batches,
                                               assert_same_greedy, engine_greedy, hf_greedy)

pytestmark = pytest.mark.timeout(600)

WINDOWS = [12, None, 12]  # the tiny arch's layer_types: sliding, full, sliding


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("gpt-oss"), arch="gpt-oss", seed=3)
    hf = hf_causal_lm(path, torch.float32, attn_implementation="eager")
    return path, load_model(path, torch.float32), hf


# ---- the MoE block against HF's ---------------------------------------------------------
def test_moe_block_matches_hf_gpt_oss_mlp():
    """HF's GptOssMLP with N(0, 1)-scaled weights, its stacked tensors placed by our loader
    hook: routing, de-interleaved and transposed experts, both biases and the clamped
    SwiGLU together. Inputs large enough that the clamps (gate above 7, up outside
    [-7, 7]) bite, so a missing clamp fails."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    config = tiny_config("gpt-oss")
    hf_block = GptOssMLP(config).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in hf_block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * config.hidden_size ** -0.5)
    net = GptOssForCausalLM(config, torch.float32)
    moe = net.model.layers[0].mlp
    assert isinstance(moe, FusedMoE) and moe.activation == "swigluoai"
    experts = hf_block.experts
    with torch.no_grad():
        moe.gate.weight.copy_(hf_block.router.weight)
        moe.gate.bias.copy_(hf_block.router.bias)
        for part in net.hf_stacked_parts:
            net.place_stacked(moe, part, f"mlp.experts.{part}", getattr(experts, part))
    x = torch.randn(23, config.hidden_size, generator=gen) * 6.0
    with torch.no_grad():
        expected, _ = hf_block(x[None])
        got = moe(x)
        gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()
    torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=1e-5)


# ---- loading ----------------------------------------------------------------------------
def test_layers_windows_and_sinks_are_hf_s(model):
    path, loaded, hf = model
    layers = loaded.model.model.layers
    assert [layer.self_attn.sliding_window for layer in layers] == WINDOWS
    assert loaded.sliding_windows == WINDOWS
    assert all(isinstance(layer.mlp, FusedMoE) for layer in layers)
    for ours, theirs in zip(layers, hf.model.layers):
        assert ours.self_attn.sinks.dtype == torch.float32
        assert torch.equal(ours.self_attn.sinks, theirs.self_attn.sinks)
    assert not loaded.model.tie_word_embeddings
    assert loaded.model.model.fused_single_decode is False


def test_sinks_are_what_the_comparisons_see(model):
    """With the sinks off, the logits leave HF's by far more than the 1e-4 the mixed-batch
    comparison allows: the tiny model's sinks matter."""
    path, loaded, hf = model
    ids = torch.randint(3, 49152, (30,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.inference_mode():
        reference = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    torch.testing.assert_close(last_logits(loaded, ids), reference, atol=1e-4, rtol=1e-4)
    unsunk = load_model(path, torch.float32)
    for layer in unsunk.model.model.layers:
        layer.self_attn.sinks = None
    assert (last_logits(unsunk, ids) - reference).abs().max() > 1e-2


def test_missing_stacked_tensor_is_refused_by_name(model):
    path, loaded, _ = model
    dropped = "model.layers.1.mlp.experts.gate_up_proj_bias"
    tensors = [(n, t) for n, t in iter_checkpoint_tensors(path) if n != dropped]
    net = GptOssForCausalLM(loaded.hf_config, torch.float32)
    with pytest.raises(ValueError, match=r"lacks 16 expert tensors, e\.g\. "
                                         r"\['model\.layers\.1\.mlp\.experts\.0\.gate_bias'"):
        net.load_weights(tensors)


def test_wrongly_shaped_stacked_tensor_is_refused(model):
    path, loaded, _ = model
    name = "model.layers.0.mlp.experts.down_proj"
    # [E, H, I] (a Linear's layout) where HF stores [E, I, H]
    tensors = [(n, t.transpose(1, 2) if n == name else t) for n, t in iter_checkpoint_tensors(path)]
    net = GptOssForCausalLM(loaded.hf_config, torch.float32)
    with pytest.raises(ValueError, match=r"down_proj' has shape \(8, 64, 32\), "
                                         r"expected \(8, 32, 64\)"):
        net.load_weights(tensors)


def test_mxfp4_tensors_under_a_dense_config_are_refused_naming_mxfp4(model):
    """MXFP4 experts (uint8 blocks and scales, as openai/gpt-oss ships) load under a config
    saying mxfp4 (test_gpt_oss_mxfp4.py); one without it refuses them by name."""
    path, loaded, _ = model
    tensors = [(n, t) for n, t in iter_checkpoint_tensors(path)
               if not n.endswith(("gate_up_proj", "down_proj"))]
    tensors.append(("model.layers.0.mlp.experts.gate_up_proj_blocks",
                    torch.zeros(8, 64, 2, 16, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="gate_up_proj_blocks.*MXFP4"):
        GptOssForCausalLM(loaded.hf_config, torch.float32).load_weights(tensors)


def test_lora_and_gguf_are_refused(model):
    from engine import LLM
    path, _, _ = model
    with pytest.raises(ValueError, match="takes no LoRA adapters"):
        LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=64, enable_lora=True)
    with pytest.raises(ValueError, match="GptOssForCausalLM, which takes no GGUF weights"):
        load_model(str(path), dtype="float32", quantization="gguf")


# ---- logits through the paged cache -------------------------------------------------------
def test_mixed_batches_match_hf(model):
    _, loaded, hf = model
    check_mixed_batches_match_hf(loaded, hf)


def test_mixed_batches_match_hf_with_per_layer_metadata(model):
    """The KV manager's layout: windowed and full layers in their own pools and tables,
    every sequence past the window within and across chunks."""
    _, loaded, hf = model
    _check_mixed_batches(("gpt-oss", None, loaded, hf), per_layer_meta=True)


def test_batch_invariant_mode_matches_hf(model):
    """batch_invariant: the sinks' rows one decode call each (kernels.dispatch)."""
    path, _, hf = model
    check_mixed_batches_match_hf(load_model(path, torch.float32, batch_invariant=True), hf)


def test_bf16_tracks_hf_bf16(model):
    """As the other MoE families' (test_moe_models.py): equally valid roundings, and a
    token near a routing tie may take other experts; our sinks stay float32."""
    path, _, _ = model
    ours = load_model(path, torch.bfloat16)
    hf = hf_causal_lm(path, torch.bfloat16, attn_implementation="eager")
    ids = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(13)).tolist()
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    got = last_logits(ours, ids)
    torch.testing.assert_close(got, expected, atol=0.15, rtol=0.05)


# ---- the whole engine ----------------------------------------------------------------------
def test_engine_greedy_matches_hf_alone_and_under_chunking_prefix_hits_and_preemption(model):
    from engine import LLM
    path, _, hf = model
    alone = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=128, max_model_len=150)
    ids = [alone.get_tokenizer().encode(p) for p in ENGINE_PROMPTS]
    assert min(len(i) for i in ids) > max(w for w in WINDOWS if w)
    reference = hf_greedy(hf, ids)
    assert_same_greedy(engine_greedy(alone, ids[2:3]), reference[2:3], "gpt-oss alone")
    # Small KV pool (a little over one max_model_len request in the windowed and full
    # groups) and step budget: chunked prefill, preemption, prefix-cache hits.
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=58, max_model_len=150,
              max_num_batched_tokens=16, long_prefill_token_threshold=7, max_num_seqs=8)
    assert_same_greedy(engine_greedy(llm, ids), reference, "gpt-oss")
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits > 0
