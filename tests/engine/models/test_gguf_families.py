"""GGUF for the families beyond Llama (Qwen3, Gemma 2, Gemma 3 text, Phi-3 with and without
LongRoPE): tiny HF folders (testing/tiny_model.py) -> bench/gguf_from_hf.py's files in
llama.cpp's layout -> (1) the layout itself, read with the gguf package; (2) transformers'
GGUF reader, an outside reader, gets the folder's weights back; (3) the engine's conversion
(engine/models/gguf_cache.py) gets the folder's config and tokenizer back; (4) the engine on
an F32 file gives the folder's greedy tokens, and with quantization="gguf" keeps Q8_0 / Q4_0 /
Q4_1 tables that dequantize exactly to the weights it converted from the same file, its
logits close to that dense model's; (5) where llama-cpp-python is installed, llama.cpp
itself gives HF's logits on the F32 files.

transformers reads Gemma 3 GGUF files from 4.52 and Qwen3 ones from 4.54: below (the
project's floor has been 4.51 and 4.53) the tests that go through its reader skip for those,
and the conversion's own refusal is tested instead."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, get_tensor_name_map
from gguf.quants import dequantize
from packaging.version import Version
from safetensors.torch import load_file

from bench.gguf_arch import FAMILIES as WRITER_FAMILIES
from bench.gguf_from_hf import write_gguf
from testing.gguf_folders import private_gguf_cache, tiny_gguf_folders
from testing.tiny_model import make_tiny_model_dir

pytestmark = pytest.mark.timeout(900)

# Test name -> (testing/tiny_model.py arch, overrides). The overrides put what llama.cpp
# derives instead of reading where llama.cpp derives it (Gemma's attention scale from
# head_dim, Gemma 3's every-6th global layer and 10000 local rope base): the tiny models'
# own off-default values have no GGUF form, and the writer refuses them (tested below).
FAMILIES = {
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=16)),
    # 7 layers: six windowed and the 6th global; the linear rope scaling travels.
    "gemma3": ("gemma3", dict(query_pre_attn_scalar=16, sliding_window_pattern=6,
                              num_hidden_layers=7, rope_local_base_freq=10000.0)),
    "phi3": ("phi3", {}),
    # LongRoPE factors as tensors, over a partial rotary (12 of 16 dims).
    "phi3-longrope": ("phi3-longrope", {}),
}
# general.architecture of each family's files, and the transformers that reads them.
GGUF_ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3",
             "phi3-longrope": "phi3"}
READER_SINCE = {"gemma3": "4.52", "qwen3": "4.54"}
# The quantized engine tests leave out plain Phi-3: phi3-longrope's tables are laid out alike.
QUANTIZED_FAMILIES = sorted(set(FAMILIES) - {"phi3"})
KINDS = ("f32", "q8_0", "q4_0", "q4_1")
QTYPES = {"f32": QT.F32, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1}
PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived a",
           "1, 2, 3, 4,", "def main():\n    print("]


def needs_reader(family: str):
    """Skip where the installed transformers' GGUF reader lacks the family."""
    since = READER_SINCE.get(GGUF_ARCH[family])
    if since and Version(transformers.__version__) < Version(since):
        pytest.skip(f"transformers {transformers.__version__} reads no {GGUF_ARCH[family]} "
                    f"GGUF (from {since})")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> its tiny HF folder, with OUT/gguf/<kind>.gguf beside, written once."""
    return tiny_gguf_folders(tmp_path_factory, FAMILIES, KINDS)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The engine's GGUF conversions go to a private cache for this module."""
    with private_gguf_cache(tmp_path_factory) as path:
        yield path


def _weights(folder) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}


def _within_quantization_error(got: np.ndarray, want: np.ndarray, kind: str, name: str) -> None:
    # One fp16 scale per 32 values: Q8_0 within half a step (plus the scale's rounding);
    # Q4_0's range is one-sided (-8..7 steps), so its far end clamps; Q4_1 spans min..max
    # in 15 steps.
    steps, slack = {"q8_0": (127, 0.6), "q4_0": (8, 1.01), "q4_1": (7.5, 0.6)}[kind]
    blocks = want.reshape(-1, 32)
    span = (np.abs(blocks).max(axis=1, keepdims=True) if kind != "q4_1"
            else (blocks.max(axis=1, keepdims=True) - blocks.min(axis=1, keepdims=True)) / 2)
    assert (np.abs(got - want).reshape(-1, 32) <= span / steps * slack + 1e-7).all(), name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_files_hold_the_folders_weights_in_llama_cpp_layout(folders, family, kind):
    folder = folders[family]
    config = json.loads((folder / "config.json").read_text())
    reader = GGUFReader(str(folder / "gguf" / f"{kind}.gguf"))
    arch = reader.get_field("general.architecture").contents()
    assert arch == GGUF_ARCH[family]
    tensors = {t.name: t for t in reader.tensors}
    names = get_tensor_name_map(WRITER_FAMILIES[config["model_type"]].arch,
                                config["num_hidden_layers"])
    gemma = family.startswith("gemma")
    expected = set()
    for hf_name, want in _weights(folder).items():
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        expected.add(name)
        t = tensors[name]
        assert list(t.shape) == list(reversed(want.shape)), name  # innermost first
        if want.ndim == 1:
            assert t.tensor_type == QT.F32, name
            # Gemma's (1 + w) norms stored as 1 + w, in float32 as llama.cpp adds it.
            want = want + np.float32(1.0) if gemma and name.endswith("norm.weight") else want
            np.testing.assert_array_equal(np.asarray(t.data), want, err_msg=name)
            continue
        assert t.tensor_type == QTYPES[kind], name
        # HF's own row order: none of these families has llama.cpp permute q and k.
        got = dequantize(t.data, t.tensor_type).reshape(want.shape)
        if kind == "f32":
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            _within_quantization_error(got, want, kind, name)
    rope = {n for n in tensors if n.startswith("rope_factors_")}
    assert set(tensors) - rope == expected
    key = f"{arch}.attention.key_length"
    if family.startswith("phi3"):
        # Fused as the checkpoint has them: attn_qkv = q, k, v rows; ffn_up = gate, up.
        assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= set(tensors)
        assert not {"blk.0.attn_q.weight", "blk.0.ffn_gate.weight"} & set(tensors)
        assert tensors["blk.0.ffn_up.weight"].shape[1] == 2 * config["intermediate_size"]
        assert reader.get_field(f"{arch}.rope.scaling.original_context_length").contents() == \
            config["original_max_position_embeddings"]
        rotary = int(config["hidden_size"] // config["num_attention_heads"]
                     * config["partial_rotary_factor"])
        assert reader.get_field(f"{arch}.rope.dimension_count").contents() == rotary
        scaling = config.get("rope_scaling")
        assert bool(rope) == bool(scaling)
        if scaling:
            for which in ("long", "short"):
                np.testing.assert_allclose(np.asarray(tensors[f"rope_factors_{which}.weight"].data),
                                           scaling[f"{which}_factor"], rtol=1e-7)
            scale = config["max_position_embeddings"] / config["original_max_position_embeddings"]
            assert reader.get_field(f"{arch}.rope.scaling.attn_factor").contents() == \
                pytest.approx(math.sqrt(1 + math.log(scale)
                                        / math.log(config["original_max_position_embeddings"])))
    else:
        assert reader.get_field(key).contents() == config["head_dim"]
    if family == "qwen3":
        assert "blk.0.attn_q_norm.weight" in tensors and "output.weight" not in tensors  # tied
    if gemma:
        assert "blk.0.post_ffw_norm.weight" in tensors and "output.weight" not in tensors
        assert reader.get_field(f"{arch}.attention.sliding_window").contents() == \
            config["sliding_window"]
        soft = reader.get_field(f"{arch}.final_logit_softcapping")  # absent: none
        assert (soft and soft.contents()) == pytest.approx(config["final_logit_softcapping"])
    if family == "gemma2":
        assert reader.get_field(f"{arch}.attn_logit_softcapping").contents() == \
            pytest.approx(config["attn_logit_softcapping"])
    if family == "gemma3":
        assert "blk.0.attn_k_norm.weight" in tensors
        assert reader.get_field(f"{arch}.rope.scaling.type").contents() == "linear"
        assert reader.get_field(f"{arch}.rope.scaling.factor").contents() == \
            config["rope_scaling"]["factor"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llama_cpp_reads_our_f32_files_to_the_folders_logits(folders, family):
    """llama.cpp itself (llama-cpp-python, where installed; not a project dependency) on
    the F32 file against HF's eager float32 forward of the folder: 80 positions, past every
    window and past Phi-3's original context (its long factors in both). KV cache in F32;
    Gemma's GELU goes through ggml's fp16 table, hence its looser bound."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from testing.hf_reference import hf_causal_lm

    folder = folders[family]
    ids = np.random.default_rng(0).integers(100, 40000, size=80).tolist()
    hf = hf_causal_lm(folder, attn_implementation="eager")
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float().numpy()
    f32 = 0  # GGML_TYPE_F32 for the KV cache
    llm = llama_cpp.Llama(str(folder / "gguf" / "f32.gguf"), n_ctx=256, n_batch=256,
                          logits_all=True, type_k=f32, type_v=f32, verbose=False)
    llm.eval(ids)
    got = np.asarray(llm.scores[:len(ids)])
    bound = 2e-3 if family.startswith("gemma") else 1e-5
    assert np.abs(got - want).max() <= bound * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_reads_our_files_back_to_the_folders_weights(folders, family, kind):
    """transformers' GGUF reader undoes llama.cpp's layout (names, Gemma's 1 + w) its own
    way; given the folder's config (its reader leaves Qwen3's head_dim at the class
    default, see the conversion test) it loads the folder's weights: exactly from F32,
    but Gemma's norms, which (1 + w) - 1 rounds in float32; within Q8_0's error."""
    from transformers import AutoConfig, AutoModelForCausalLM

    needs_reader(family)
    folder = folders[family]
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=f"gguf/{kind}.gguf", config=AutoConfig.from_pretrained(folder),
        torch_dtype=torch.float32)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    for name, want in _weights(folder).items():
        got = state[name]
        if want.ndim == 1:
            atol = 2.0 ** -23 if family.startswith("gemma") and "norm" in name else 0.0
            np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=name)
        elif kind == "f32":
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            _within_quantization_error(got, want, kind, name)


# What the conversion must carry for the model to compute what the folder's does.
CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta",
               "rope_scaling", "tie_word_embeddings", "vocab_size", "sliding_window",
               "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
               "rope_local_base_freq", "layer_types", "original_max_position_embeddings",
               "partial_rotary_factor", "hidden_activation", "hidden_act")


def _same(got, want) -> bool:
    """Equal, floats to float32's precision: they went through the file (eps, Phi-3's
    rope factors)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and \
            all(_same(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and \
            all(_same(g, w) for g, w in zip(got, want))
    if isinstance(want, float):
        return got == pytest.approx(want, rel=1e-6)
    return got == want


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_conversion_gives_the_folders_config_and_tokenizer(folders, cache_dir, family):
    from transformers import AutoConfig, AutoTokenizer

    from engine.models.gguf_cache import converted_dir_for

    needs_reader(family)
    folder = folders[family]
    converted = converted_dir_for(folder / "gguf" / "f32.gguf")
    want, got = AutoConfig.from_pretrained(folder), AutoConfig.from_pretrained(converted)
    assert type(got) is type(want)
    for key in CONFIG_KEYS:
        assert _same(getattr(got, key, None), getattr(want, key, None)), key
    ours, theirs = AutoTokenizer.from_pretrained(converted), AutoTokenizer.from_pretrained(folder)
    for prompt in [*PROMPTS, "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(prompt) == theirs.encode(prompt), prompt
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_on_the_f32_file_gives_the_folders_greedy_tokens(folders, cache_dir, family):
    from engine import LLM, SamplingParams

    needs_reader(family)
    folder = folders[family]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    # One prompt past Phi-3's original context (64 here: the long factors) and every window.
    prompts = [*PROMPTS, "The quick brown fox jumps over the lazy dog. " * 7]
    runs = []
    for model in (folder, folder / "gguf" / "f32.gguf"):
        llm = LLM(str(model), dtype="float32", num_kv_blocks=256, block_size=16,
                  max_model_len=256)
        ids = [llm.get_tokenizer().encode(p) for p in prompts]
        runs.append((ids, llm.generate(ids, params, use_tqdm=False)))
    (ids_a, a), (ids_b, b) = runs
    assert ids_a == ids_b
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            for tok, p in lx.items():
                assert ly[tok].logprob == pytest.approx(p.logprob, abs=1e-4)


@pytest.fixture(scope="module")
def dense_from(folders, cache_dir):
    """(family, kind) -> the engine's dense float32 model converted from that file."""
    from engine.models import load_model

    made = {}

    def load(family: str, kind: str):
        if (family, kind) not in made:
            made[family, kind] = load_model(str(folders[family] / "gguf" / f"{kind}.gguf"),
                                            torch.float32)
        return made[family, kind]
    return load


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("family", QUANTIZED_FAMILIES)
def test_quantized_tables_hold_exactly_the_files_values(folders, dense_from, family, kind):
    """Every fused table (q/k/v: split, or Phi-3's attn_qkv; gate/up: split, or Phi-3's
    ffn_up holding both), o_proj, down_proj and the tied or separate embedding/output
    tables dequantize to what the engine loaded densely from the same file."""
    from engine.models.gguf_weights import read_quantized

    needs_reader(family)
    dense = dense_from(family, kind)
    net = dense.model
    tables = read_quantized(folders[family] / "gguf" / f"{kind}.gguf", net)
    layers = dense.num_layers
    assert len(tables) == 4 * layers + 2
    assert {t.type_name for t in tables.values()} == {kind.upper()}
    tied = net.tie_word_embeddings
    assert (tables["lm_head"] is tables["model.embed_tokens"]) == tied
    modules = dict(net.named_modules())
    for name, table in tables.items():
        if name == "model.embed_tokens" or (name == "lm_head" and tied):
            expected = net.model.embed_tokens.weight
        elif name == "lm_head":
            expected = net.lm_head_weight
        else:
            expected = modules[name].dense_weight()
        assert torch.equal(table.dequantize(), expected.float()), name


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize("family", QUANTIZED_FAMILIES)
def test_quantized_model_stays_close_to_the_dense_one(folders, dense_from, family, kind):
    """The kernels' int8 activations (per 32-block, as llama.cpp's) against the dense model
    of the same file's values: the tables' layout is exact (above), so only the activation
    rounding is left."""
    from engine.models import load_model
    from engine.models.layers import Linear
    from kernels import dispatch
    from testing.model_batch import last_logits

    needs_reader(family)
    if not dispatch.gguf_kernel_available():
        pytest.skip("no native GGUF kernel on this host: the weights would stay dense")
    path = folders[family] / "gguf" / f"{kind}.gguf"
    quantized = load_model(str(path), torch.float32, quantization="gguf")
    linears = [m for m in quantized.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and m.prepared.kind == "gguf" for m in linears)
    dense = dense_from(family, kind)
    tok = dense.tokenizer
    # Measured: 1-3% of the largest logit (the default SmolLM2 file: 3-5%, bound 8%). The
    # tiny Gemma 3 from transformers 4.53 starts its norms at 1, so (1 + w) doubles every
    # norm and the model magnifies any rounding: 4-10% there, its Q8_0 weights alone 8%.
    bound = 0.12 if family == "gemma3" else 0.08
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        want, got = last_logits(dense, ids), last_logits(quantized, ids)
        assert float((got - want).abs().max()) < bound * float(want.abs().max()), prompt
        assert int(got.argmax()) in want.topk(3).indices.tolist(), prompt


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_conversion_names_the_transformers_an_architecture_needs(folders, tmp_path,
                                                                 monkeypatch, family):
    """transformers before 4.54 has no Qwen3 GGUF reader, before 4.52 no Gemma 3 one: the
    conversion says which version does, rather than failing on a missing key. Here the reader's
    table is stripped of the architecture, so the check runs at any version."""
    from transformers.integrations import ggml

    from engine.models.gguf_cache import converted_dir_for

    monkeypatch.setenv("TLE_CACHE_DIR", str(tmp_path))  # not converted yet
    monkeypatch.delitem(ggml.GGUF_CONFIG_MAPPING, GGUF_ARCH[family], raising=False)
    since = READER_SINCE[GGUF_ARCH[family]]
    with pytest.raises(ValueError, match=rf"GGUF architecture '{GGUF_ARCH[family]}' needs "
                                         rf"transformers >= {since}.*{transformers.__version__}"):
        converted_dir_for(folders[family] / "gguf" / "f32.gguf")


@pytest.mark.parametrize("arch, overrides, match", [
    ("gemma2", dict(query_pre_attn_scalar=12), "query_pre_attn_scalar 12"),
    ("gemma2", dict(query_pre_attn_scalar=16, tie_word_embeddings=False), "untied lm_head"),
    ("gemma3", dict(query_pre_attn_scalar=16, rope_local_base_freq=100.0,
                    sliding_window_pattern=6), "rope_local_base_freq 100"),
    ("gemma3", dict(query_pre_attn_scalar=16, rope_local_base_freq=10000.0,
                    sliding_window_pattern=2), "layer_types|sliding_window_pattern"),
])
def test_writer_refuses_what_llama_cpp_would_misread(tmp_path, arch, overrides, match):
    """llama.cpp derives Gemma's attention scale, sliding pattern and Gemma 3's local rope
    base instead of reading them: a config apart from the derivation gets no file."""
    folder = make_tiny_model_dir(tmp_path / "m", arch=arch, seed=0, **overrides)
    with pytest.raises(ValueError, match=match):
        write_gguf(folder, tmp_path / "out.gguf", "f32")
    assert not (tmp_path / "out.gguf").exists()
