"""bench/make_model.py: its tiny shape gives the engine and HF transformers the same greedy
tokens, and its GGUF files hold the same weights and tokenizer in llama.cpp's layout (read
back with the gguf package, and with transformers, which undoes llama.cpp's layout). The
MoE shapes: their models' parameter counts and HF's tensors, and scaled-down folders cut
by `layers` that HF and the engine read alike."""
import json
import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file

from bench.gguf_from_hf import llama3_rope_factors, permute_heads
from bench.make_model import SHAPES, config_for, make_model, weight_shapes

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived a",
           "1, 2, 3, 4,", "def main():\n    print("]
KINDS = {"bf16": QT.BF16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("tiny"), seed=0, gguf=tuple(KINDS))


@pytest.fixture(scope="module")
def weights(tiny):
    return {k: v.float() for k, v in load_file(str(tiny / "model.safetensors")).items()}


def test_the_1b_shape_has_llama_3_2_1b_parameter_count():
    shapes = weight_shapes(SHAPES["llama-3.2-1b"]).values()
    assert sum(math.prod(s) for s in shapes) == 1_235_814_400  # its model card's 1.23B


def test_tiny_greedy_output_matches_hf_and_is_not_degenerate(tiny):
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams

    llm = LLM(str(tiny), dtype="float32", num_kv_blocks=256, block_size=16, max_model_len=512)
    tok = llm.get_tokenizer()
    assert len(tok) == SHAPES["tiny"]["vocab_size"]
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    hf = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, got in zip(ids, ours):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert got == want[0, len(prompt):].tolist()
        # Random weights at a bad scale repeat the prompt's last token forever.
        assert len(set(got)) > 6, got


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_gguf_holds_the_folders_weights_in_llama_cpp_layout(tiny, weights, kind):
    config = json.loads((tiny / "config.json").read_text())
    reader = GGUFReader(str(tiny / "gguf" / f"tiny-{kind.upper()}.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied: llama.cpp reads token_embd
    assert len(reader.get_field("tokenizer.ggml.tokens").data) == config["vocab_size"]
    assert reader.get_field("llama.rope.freq_base").contents() == config["rope_theta"]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "blk.1.attn_norm.weight": "model.layers.1.input_layernorm.weight",
             "blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj.weight",
             "blk.1.attn_k.weight": "model.layers.1.self_attn.k_proj.weight",
             "blk.1.attn_v.weight": "model.layers.1.self_attn.v_proj.weight",
             "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight"}
    for name, hf_name in pairs.items():
        t, want = tensors[name], weights[hf_name].numpy()
        kind_name = name.split(".")[-2]
        if kind_name in heads:
            want = permute_heads(want, heads[kind_name])
        assert t.tensor_type == (QT.F32 if want.ndim == 1 else KINDS[kind]), name
        assert list(t.shape) == list(reversed(want.shape)), name  # GGUF lists innermost first
        got = dequantize(t.data, t.tensor_type).reshape(want.shape)
        if t.tensor_type in (QT.F32, QT.BF16):
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            # One fp16 scale per 32 values: Q8_0 within half a step (plus the scale's
            # rounding); Q4_0's range is one-sided (-8..7 steps), so its far end clamps.
            steps, slack = (127, 0.6) if kind == "q8_0" else (8, 1.01)
            step = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / steps
            assert (np.abs(got - want).reshape(-1, 32) <= step * slack).all(), name
    assert len(reader.tensors) == 2 + 9 * config["num_hidden_layers"] + 1  # + rope_freqs


def test_q_and_k_row_order_is_the_one_the_engines_gguf_loader_undoes():
    from engine.models.gguf_weights import _head_rows_order

    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    np.testing.assert_array_equal(permute_heads(w, 8)[_head_rows_order(8, 8 * 16).numpy()], w)


def test_rope_freqs_give_the_engines_llama3_frequencies(tiny):
    from transformers import AutoConfig

    from engine.models.rope import _base_inv_freq, rope_inv_freq

    config = json.loads((tiny / "config.json").read_text())
    ours, _ = rope_inv_freq(AutoConfig.from_pretrained(tiny))
    base = _base_inv_freq(config["rope_theta"], config["head_dim"])
    factors = torch.from_numpy(llama3_rope_factors(config))
    assert {1.0, 32.0} < set(factors.tolist())  # all three llama3 bands present
    torch.testing.assert_close(base / factors, ours, rtol=1e-6, atol=0)


def test_transformers_reads_the_bf16_gguf_back_to_the_folders_weights_and_tokenizer(tiny, weights):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = "gguf/tiny-BF16.gguf"
    model = AutoModelForCausalLM.from_pretrained(tiny, gguf_file=name, torch_dtype=torch.float32)
    state = model.state_dict()
    for key, want in weights.items():
        torch.testing.assert_close(state[key], want, rtol=0, atol=0, msg=key)
    from_gguf = AutoTokenizer.from_pretrained(tiny, gguf_file=name)
    from_folder = AutoTokenizer.from_pretrained(tiny)
    for prompt in PROMPTS:
        assert from_gguf.encode(prompt, add_special_tokens=False) == from_folder.encode(prompt)


def test_gguf_convert_widens_bf16_to_f32_for_an_f32_engine(tiny, tmp_path):
    from bench.gguf_convert import convert

    src = tiny / "gguf" / "tiny-BF16.gguf"
    convert(src, tmp_path / "f32.gguf", "F32")
    before = {t.name: t for t in GGUFReader(str(src)).tensors}
    after = GGUFReader(str(tmp_path / "f32.gguf"))
    assert after.get_field("general.file_type").contents() == 0  # ALL_F32
    for t in after.tensors:
        assert t.tensor_type == QT.F32, t.name
        old = before[t.name]
        np.testing.assert_array_equal(np.asarray(t.data).reshape(-1),
                                      dequantize(old.data, old.tensor_type).reshape(-1), err_msg=t.name)


# ---- the mixture-of-experts shapes ------------------------------------------------------
def test_moe_shapes_have_their_models_parameter_counts():
    from engine.models import default_model_dir

    def count(config):
        return sum(math.prod(s) for s in weight_shapes(config).values())

    qwen = config_for("qwen3-30b-a3b", default_model_dir())
    experts = sum(math.prod(s) for n, s in weight_shapes(qwen).items() if ".experts." in n)
    active = count(qwen) - experts + experts * 8 // 128  # top 8 of 128
    # Its model card: 30.5B in total, 3.3B activated (3.35B here: the card cuts, not rounds).
    assert round(count(qwen) / 1e8) == 305 and 3.3e9 <= active < 3.4e9
    # Mixtral-8x7B's exact count, at its own vocabulary (the shape pads it to the tokenizer's).
    mixtral = {**config_for("mixtral-8x7b", default_model_dir()), "vocab_size": 32000}
    assert count(mixtral) == 46_702_792_704


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_moe_shapes_are_what_transformers_builds_from_the_config(shape):
    """Cut to 2 layers (--layers): the names and shapes HF's model has, on the meta device."""
    from engine.models import default_model_dir
    from tests.bench.test_make_model_families import _hf_model_on_meta

    config = config_for(shape, default_model_dir(), layers=2)
    assert config["num_hidden_layers"] == 2
    model = _hf_model_on_meta(config)
    assert type(model).__name__ == config["architectures"][0]
    assert weight_shapes(config) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


# Scaled-down Qwen3-MoE (layer 1 dense: mlp_only_layers; 3 layers, of which --layers keeps
# 2) and Mixtral, written by make_model as the big shapes are.
TINY_MOE = {
    "qwen3-tiny-moe": dict(SHAPES["tiny"], num_hidden_layers=3, rope_scaling=None,
                           tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                           mlp_only_layers=[1]),
    "mixtral-tiny": dict(SHAPES["tiny"], rope_scaling=None, num_local_experts=8,
                         num_experts_per_tok=2, intermediate_size=32),
}


@pytest.mark.parametrize("shape", sorted(TINY_MOE))
def test_tiny_moe_folder_loads_in_hf_and_the_engine_with_the_same_greedy_tokens(
        shape, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.models.moe import FusedMoE

    monkeypatch.setitem(SHAPES, shape, TINY_MOE[shape])
    if shape == "qwen3-tiny-moe":
        # llama.cpp's qwen3moe makes every layer MoE: a dense layer has no GGUF form.
        with pytest.raises(ValueError, match="mlp_only_layers"):
            make_model(shape, tmp_path / "refused", gguf=("bf16",))
        assert not (tmp_path / "refused").exists()  # refused before writing anything
    else:
        written = make_model(shape, tmp_path / "with-gguf", gguf=("q8_0",), layers=2)
        assert (written / "gguf" / f"{shape}-Q8_0.gguf").stat().st_size > 0
    out = make_model(shape, tmp_path / shape, seed=0, layers=2)
    hf, info = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32,
                                                     output_loading_info=True)
    assert not any(info.values()), info  # every tensor used, none missing
    hf.eval().generation_config.eos_token_id = None
    llm = LLM(str(out), dtype="float32", num_kv_blocks=256, block_size=16, max_model_len=512)
    layers = llm.llm_engine.loaded.model.model.layers
    assert [isinstance(layer.mlp, FusedMoE) for layer in layers] == \
        ([True, False] if shape.startswith("qwen3") else [True, True])
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    for prompt, o in zip(ids, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                               pad_token_id=0)
        assert list(o.outputs[0].token_ids) == want[0, len(prompt):].tolist()
