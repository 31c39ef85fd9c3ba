"""gpt-oss from an MXFP4 checkpoint (engine/models/gpt_oss.py's Mxfp4FusedMoE) against HF
transformers reading the same folder: the tiny gpt-oss (testing/tiny_model.py) with its
experts quantized to MXFP4 as openai/gpt-oss ships them (testing/mxfp4.py).

HF without triton_kernels (any CPU host) loads MXFP4 by dequantizing the experts to bf16,
whatever dtype is asked; bf16 holds every MXFP4 value exactly, so the float32 reference
here is that model cast to float32: HF's own reading of the folder, in float32.
"""
from __future__ import annotations

import copy

import pytest
import torch

from engine.models import load_model
from engine.models.gpt_oss import GptOssForCausalLM, Mxfp4FusedMoE
from engine.models.loader import iter_checkpoint_tensors
from kernels.torch_mxfp4 import Mxfp4Stack
from testing.hf_reference import hf_causal_lm
from testing.model_batch import check_mixed_batches_match_hf, last_logits
from testing.mxfp4 import quantize_gpt_oss_dir
from testing.tiny_model import make_tiny_model_dir
from tests.engine.models.test_families import (ENGINE_PROMPTS, assert_same_greedy,
                                               engine_greedy, hf_greedy)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    dense = make_tiny_model_dir(root / "dense", arch="gpt-oss", seed=3)
    quantize_gpt_oss_dir(dense, root / "mxfp4", root / "dequantized")
    return dense, root / "mxfp4", root / "dequantized"


@pytest.fixture(scope="module")
def model(folders):
    _, path, _ = folders
    hf = hf_causal_lm(path, torch.float32, attn_implementation="eager").float()
    return path, load_model(path, torch.float32), hf


def test_hf_reads_the_folder_as_the_quantizer_dequantized_it(folders, model):
    """The reference is sound: the folder holds uint8 blocks and scales only (no dense
    experts), HF's reading of it is exactly the quantizer's own dequantized model, and
    that differs from the dense model it came from (quantization happened)."""
    dense, path, dequantized = folders
    names = {name: t.dtype for name, t in iter_checkpoint_tensors(path)}
    assert names["model.layers.0.mlp.experts.gate_up_proj_blocks"] == torch.uint8
    assert names["model.layers.0.mlp.experts.down_proj_scales"] == torch.uint8
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    hf = model[2].state_dict()
    restored = hf_causal_lm(dequantized, torch.float32, attn_implementation="eager").state_dict()
    original = hf_causal_lm(dense, torch.float32, attn_implementation="eager").state_dict()
    assert hf.keys() == restored.keys()
    for name in hf:
        assert hf[name].dtype == restored[name].dtype and torch.equal(hf[name], restored[name])
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(hf[name], original[name])


def test_experts_stay_mxfp4_and_are_hf_s_experts(model):
    """Every layer's experts are uint8 blocks and scales (no dense copy held), and expert
    e's stacks dequantize to HF's: gate rows then up rows of its interleaved gate_up_proj,
    and its down_proj transposed."""
    _, loaded, hf = model
    for ours, theirs in zip(loaded.model.model.layers, hf.model.layers):
        moe = ours.mlp
        assert isinstance(moe, Mxfp4FusedMoE)
        held = {name: t.dtype for name, t in moe.named_parameters()}
        held.update({name: t.dtype for name, t in moe.named_buffers()})
        assert "w13" not in held and "w2" not in held
        assert {held[n] for n in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales")} == \
            {torch.uint8}
        assert isinstance(moe.w13, Mxfp4Stack) and moe.w13.dtype == torch.float32
        experts = theirs.mlp.experts
        for e in range(moe.num_experts):
            gate_up = experts.gate_up_proj[e]  # [H, 2I], gate and up interleaved
            assert torch.equal(moe.w13[e], torch.cat([gate_up[:, 0::2].T, gate_up[:, 1::2].T]))
            assert torch.equal(moe.w2[e], experts.down_proj[e].T)


def test_mixed_batches_match_hf(model):
    _, loaded, hf = model
    check_mixed_batches_match_hf(loaded, hf)


def test_batch_invariant_mode_matches_hf(model):
    path, _, hf = model
    check_mixed_batches_match_hf(load_model(path, torch.float32, batch_invariant=True), hf)


def test_engine_greedy_and_logprobs_match_hf(model):
    """The whole engine on the MXFP4 folder under chunked prefill, preemption and prefix
    hits (test_gpt_oss.py's settings): HF's greedy tokens, logprobs within 1e-3."""
    from engine import LLM
    path, _, hf = model
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=58, max_model_len=150,
              max_num_batched_tokens=16, long_prefill_token_threshold=7, max_num_seqs=8)
    ids = [llm.get_tokenizer().encode(p) for p in ENGINE_PROMPTS]
    assert_same_greedy(engine_greedy(llm, ids), hf_greedy(hf, ids), "gpt-oss mxfp4")
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0


def test_bf16_tracks_hf_bf16(model):
    """bf16 against HF's bf16 on the same folder (its CPU path as it is): equally valid
    roundings, as test_gpt_oss.py's bf16 test allows."""
    path, _, _ = model
    ours = load_model(path, torch.bfloat16)
    assert ours.model.model.layers[0].mlp.w13.dtype == torch.bfloat16
    hf = hf_causal_lm(path, torch.bfloat16, attn_implementation="eager")
    ids = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(13)).tolist()
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    torch.testing.assert_close(last_logits(ours, ids), expected, atol=0.15, rtol=0.05)


# ---- what the loader refuses ---------------------------------------------------------------
def test_mxfp4_tensors_under_a_dense_config_are_refused(folders, model):
    dense, path, _ = folders
    config = copy.deepcopy(model[1].hf_config)
    config.quantization_config = None
    with pytest.raises(ValueError, match=r"experts\.\w+_proj_blocks'.*MXFP4 experts, but the "
                                         r"config's quantization_config does not say mxfp4"):
        GptOssForCausalLM(config, torch.float32).load_weights(iter_checkpoint_tensors(path))
    # and dense experts under an MXFP4 config
    with pytest.raises(ValueError, match=r"experts\.\w+_proj'.*dense experts, but the "
                                         r"config says MXFP4"):
        GptOssForCausalLM(model[1].hf_config, torch.float32).load_weights(
            iter_checkpoint_tensors(dense))


def test_missing_scales_and_wrong_blocks_are_refused_by_name(model):
    path, loaded, _ = model
    dropped = "model.layers.2.mlp.experts.down_proj_scales"
    tensors = [(n, t) for n, t in iter_checkpoint_tensors(path) if n != dropped]
    with pytest.raises(ValueError, match=r"lacks 8 expert tensors, e\.g\. "
                                         r"\['model\.layers\.2\.mlp\.experts\.0\.down_scales'"):
        GptOssForCausalLM(loaded.hf_config, torch.float32).load_weights(tensors)
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    tensors = [(n, t[:, :, :1] if n == name else t) for n, t in iter_checkpoint_tensors(path)]
    with pytest.raises(ValueError, match=r"gate_up_proj_blocks' is torch\.uint8 "
                                         r"\(8, 64, 1, 16\), expected torch\.uint8 "
                                         r"\(8, 64, 2, 16\)"):
        GptOssForCausalLM(loaded.hf_config, torch.float32).load_weights(tensors)


def test_other_quantization_methods_and_unaligned_sizes_are_refused(model):
    config = copy.deepcopy(model[1].hf_config)
    config.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match="quantization_config 'bitsandbytes'"):
        GptOssForCausalLM(config, torch.float32)
    config = copy.deepcopy(model[1].hf_config)
    config.intermediate_size = 40
    with pytest.raises(ValueError, match="MXFP4 experts need intermediate_size a multiple "
                                         "of 32, got 40"):
        GptOssForCausalLM(config, torch.float32)
