"""load_model on HF folders (safetensors and .bin), its errors, and the GGUF cache keying.
Tests needing the real SmolLM2 weights are marked slow."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from engine.models import default_model_dir, load_model
from engine.models import gguf_cache
from engine.models import loader as loader_module
from engine.models.layers import Linear
from engine.models.loader import resolve_dtype
from testing.tiny_model import make_tiny_model_dir
from kernels.cpu import features as cpu_features
from testing.model_batch import hf_logits, last_logits
from testing.hf_reference import hf_causal_lm

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), arch="llama", seed=5)


def test_hf_folder_facts(tiny_dir):
    loaded = load_model(str(tiny_dir), torch.float32)
    assert loaded.model_dir == tiny_dir
    assert (loaded.num_layers, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim) == (2, 4, 2, 16)
    assert (loaded.hidden_size, loaded.vocab_size, loaded.max_position_embeddings) == (64, 49152, 2048)
    assert loaded.eos_token_ids == [2] and loaded.eos_token_id == 2
    assert loaded.kv_cache_bytes_per_token() == 2 * 2 * 2 * 16 * 4
    assert loaded.hf_config.model_type == "llama"
    assert loaded.tokenizer.decode(loaded.tokenizer("hello there")["input_ids"]) == "hello there"
    # Fused projections hold the HF tensors side by side.
    hf_state = load_file(tiny_dir / "model.safetensors")
    attn = loaded.model.model.layers[1].self_attn
    expected_qkv = torch.cat([hf_state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.dense_weight(), expected_qkv)
    # where float32 weights become the native GEMM's panels, those are the only copy
    assert (attn.qkv_proj.weight is None) == (attn.qkv_proj.prepared.kind == "panels")
    assert not loaded.model.tie_word_embeddings
    assert torch.equal(loaded.model.lm_head_weight, hf_state["lm_head.weight"])


def test_qwen2_tied_embeddings_and_bias(tmp_path):
    path = make_tiny_model_dir(tmp_path, arch="qwen2", seed=2)
    loaded = load_model(path, torch.float32)
    assert loaded.model.lm_head_weight is loaded.model.model.embed_tokens.weight
    attn = loaded.model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    hf_state = load_file(path / "model.safetensors")
    assert torch.equal(attn.qkv_proj.bias[:64], hf_state["model.layers.0.self_attn.q_proj.bias"])


def _features(isa: str) -> cpu_features.CpuFeatures:
    flags = frozenset().union(*(needs for level, needs in cpu_features._NEEDS.items()
                                if cpu_features.X86_LEVELS.index(level)
                                <= cpu_features.X86_LEVELS.index(isa)))
    return cpu_features.CpuFeatures("x86_64", flags, isa, isa, 2)


@pytest.mark.parametrize("isa, expected", [("baseline", torch.float32), ("avx2", torch.float32),
                                           ("avx512", torch.float32),
                                           ("avx512_bf16", torch.bfloat16),
                                           ("amx", torch.bfloat16)])
def test_auto_dtype_follows_the_cpu(tiny_dir, monkeypatch, isa, expected):
    config = AutoConfig.from_pretrained(tiny_dir)  # an fp32 checkpoint
    monkeypatch.setattr(cpu_features, "detect", lambda: _features(isa))
    monkeypatch.setattr(loader_module, "detect_cpu", cpu_features.detect)
    assert resolve_dtype("auto", config, "cpu") == expected
    assert resolve_dtype(None, config, "cpu") == expected
    # On a GPU the CPU does not matter: an fp32 checkpoint runs in bf16, as in vLLM.
    assert resolve_dtype("auto", config, "cuda") == torch.bfloat16


def test_auto_dtype_loads_on_this_cpu(tiny_dir):
    features = cpu_features.detect()
    loaded = load_model(tiny_dir, "auto")
    expected = torch.bfloat16 if features.native_bf16 else torch.float32
    assert loaded.dtype == expected
    assert loaded.model.model.layers[0].mlp.gate_up_proj.dense_weight().dtype == expected
    assert loaded.kv_cache_bytes_per_token() == 2 * 2 * 2 * 16 * expected.itemsize


def test_explicit_bf16_runs_unpacked_where_oneDNN_cannot_prepack(tiny_dir, monkeypatch, caplog):
    """An AVX2-only CPU: oneDNN refuses the bf16 weight reorder; the model must still load
    (plain F.linear, slower) and say why, and agree with the prepacked-or-not fp32 run."""
    monkeypatch.setattr(cpu_features, "detect", lambda: _features("avx2"))
    monkeypatch.setattr(loader_module, "detect_cpu", cpu_features.detect)
    with caplog.at_level("WARNING", logger="engine.models.loader"):
        bf16 = load_model(tiny_dir, "bfloat16")
    assert "emulated" in caplog.text and "avx2" in caplog.text
    prepared = [m.prepared for m in bf16.model.modules() if isinstance(m, Linear)]
    assert prepared and all(w.kind == "dense" for w in prepared + [bf16.model.lm_head_prepared])
    toks = [5, 99, 1234, 40000, 7]
    got = last_logits(bf16, toks).float()
    ref = last_logits(load_model(tiny_dir, torch.float32), toks)
    assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max()) + 0.05


def test_bin_checkpoint_fallback(tiny_dir, tmp_path):
    bin_dir = tmp_path / "bin"
    shutil.copytree(tiny_dir, bin_dir)
    state = load_file(bin_dir / "model.safetensors")
    (bin_dir / "model.safetensors").unlink()
    torch.save(state, bin_dir / "pytorch_model.bin")
    toks = [5, 99, 1234, 40000, 7]
    ours = last_logits(load_model(bin_dir, torch.float32), toks)
    hf = hf_causal_lm(tiny_dir, torch.float32)
    torch.testing.assert_close(ours, hf_logits(hf, toks)[-1], atol=1e-4, rtol=1e-4)


def test_generation_config_eos_wins(tiny_dir, tmp_path):
    folder = tmp_path / "eos"
    shutil.copytree(tiny_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 7]}))
    assert load_model(folder, torch.float32).eos_token_ids == [7, 2]


@pytest.mark.parametrize("bad, field", [("bfloat17", "dtype")])
def test_bad_dtype(bad, field):
    with pytest.raises(ValueError, match=field):
        resolve_dtype(bad, None)


def test_missing_and_unsupported_models(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="model"):
        load_model(tmp_path / "nope", torch.float32)
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path, torch.float32)
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architectures"):
        load_model(folder, torch.float32)


def test_incomplete_or_misshapen_checkpoint(tiny_dir, tmp_path):
    state = load_file(tiny_dir / "model.safetensors")
    folder = tmp_path / "partial"
    shutil.copytree(tiny_dir, folder)
    save_file({k: v for k, v in state.items() if "layers.1.self_attn.k_proj" not in k},
              folder / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 tensors.*qkv_proj"):
        load_model(folder, torch.float32)
    bad = dict(state)
    up = "model.layers.0.mlp.up_proj.weight"
    bad[up] = bad[up][:, :32].contiguous()
    save_file(bad, folder / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj.weight.*shape"):
        load_model(folder, torch.float32)


def test_gguf_cache_key_and_reuse(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TLE_CACHE_DIR", str(cache))
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    calls = []

    def fake_convert(src, out):
        calls.append(src)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_cache, "_convert", fake_convert)
    first = gguf_cache.converted_dir_for(fake)
    assert first.parent == cache and (first / "config.json").is_file()
    assert gguf_cache.converted_dir_for(fake) == first and len(calls) == 1
    # The same bytes elsewhere (a second clone, a reinstall) share the entry.
    clone = tmp_path / "clone" / "m.gguf"
    clone.parent.mkdir()
    clone.write_bytes(b"GGUF")
    assert gguf_cache.converted_dir_for(clone) == first and len(calls) == 1
    # Another living file of the same name keeps its own entry beside ours.
    (clone.parent / "m.gguf").write_bytes(b"GGUF-other")
    other = gguf_cache.converted_dir_for(clone)
    assert other != first and first.is_dir() and len(calls) == 2
    # A changed file gets a new entry, and its old one goes (one copy per file, not one
    # per version ever seen).
    fake.write_bytes(b"GGUF-v2")
    second = gguf_cache.converted_dir_for(fake)
    assert second != first and len(calls) == 3
    assert not first.exists() and other.is_dir()
    # An entry whose file is gone goes at the next conversion of that name; a crashed
    # conversion's leftovers go once they are a day old, a running one's stay.
    clone.unlink()
    crashed, running = cache / ".convert-crashed", cache / ".convert-running"
    crashed.mkdir(), running.mkdir()
    os.utime(crashed, (1, 1))
    fake.write_bytes(b"GGUF-v3")
    third = gguf_cache.converted_dir_for(fake)
    assert sorted(p.name for p in cache.iterdir()) == sorted([third.name, running.name])
    # Only the head, the tail and sampled windows are read: a byte changed in a large
    # file's sampled region changes the key.
    big = bytearray(64 << 20)
    fake.write_bytes(bytes(big))
    key = gguf_cache._cache_key(fake)
    big[-1] = 1
    fake.write_bytes(bytes(big))
    assert gguf_cache._cache_key(fake) != key


@pytest.mark.slow
def test_default_model_matches_hf():
    loaded = load_model(None, torch.bfloat16)
    config = loaded.hf_config
    assert loaded.model_dir == default_model_dir()
    assert (loaded.num_layers, loaded.hidden_size, loaded.num_heads, loaded.num_kv_heads,
            loaded.head_dim, loaded.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert config.rope_theta == 1e5 and config.tie_word_embeddings
    assert loaded.eos_token_ids == [2]
    assert loaded.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True)
    hf = hf_causal_lm(loaded.model_dir, torch.float32)
    expected = hf_logits(hf, prompt)[-1]
    bf16 = last_logits(loaded, prompt)
    # The top two logits of this prompt are ~0.1 apart, within bf16 noise, so only ask
    # that bf16's choice be one of the reference's top three.
    assert int(bf16.argmax()) in expected.topk(3).indices.tolist()
    # bf16 weights and activations through 30 layers vs an fp32 reference.
    assert float((bf16 - expected).abs().max()) < 0.05 * float(expected.abs().max()) + 0.5
    fp32 = last_logits(load_model(None, torch.float32), prompt)
    torch.testing.assert_close(fp32, expected, atol=1e-3, rtol=1e-4)
    assert int(fp32.argmax()) == int(expected.argmax())
