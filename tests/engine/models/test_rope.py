"""RoPE frequency tables and scaled-RoPE models vs HF transformers."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.models import load_model
from engine.models.rope import RotaryEmbedding, rope_inv_freq
from testing.tiny_model import make_tiny_model_dir
from testing.model_batch import PagedBatchBuilder, hf_logits
from testing.hf_reference import hf_causal_lm

pytestmark = pytest.mark.timeout(300)

SCALINGS = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    # Old-style key name ("type") as in many published configs.
    "linear_legacy_key": {"type": "linear", "factor": 2.0},
    # original_max 64 puts the head_dim-16 wavelengths in all three llama3 bands.
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def _config(scaling):
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, rope_theta=10000.0, rope_scaling=scaling)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inv_freq_matches_hf(name):
    config = _config(SCALINGS[name])
    rope_type = (config.rope_scaling or {}).get("rope_type", "default")
    expected, expected_mult = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    ours, mult = rope_inv_freq(config)
    torch.testing.assert_close(ours, expected.float(), atol=0, rtol=1e-6)
    assert mult == pytest.approx(expected_mult)


def test_scaled_variants_differ_from_plain():
    # Guards the parametrised test above against configs that silently ignore scaling.
    plain, _ = rope_inv_freq(_config(None))
    for name in ("linear", "llama3", "yarn"):
        scaled, _ = rope_inv_freq(_config(SCALINGS[name]))
        assert not torch.allclose(scaled, plain), name


def test_unsupported_rope_type_is_rejected():
    config = _config(None)
    config.rope_scaling = {"rope_type": "longrope", "factor": 2.0}
    with pytest.raises(ValueError, match="rope_scaling"):
        rope_inv_freq(config)


def test_rotation_preserves_norm_and_relative_angle():
    rotary = RotaryEmbedding(_config(None), torch.float32)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 16, generator=gen)
    # <R(m)q, R(n)k> depends only on m - n.
    def dot(m, n):
        qm = rotary(rotary.lookup(torch.tensor([m])), q)
        kn = rotary(rotary.lookup(torch.tensor([n])), k)
        return float((qm * kn).sum())
    assert dot(7, 3) == pytest.approx(dot(104, 100), rel=1e-4)
    rotated = rotary(rotary.lookup(torch.tensor([37])), q)
    assert float(rotated.norm()) == pytest.approx(float(q.norm()), rel=1e-5)


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn"])
def test_scaled_model_matches_hf(tmp_path, name):
    path = make_tiny_model_dir(tmp_path / name, arch="llama", seed=3, num_hidden_layers=1,
                               rope_scaling=SCALINGS[name], max_position_embeddings=256)
    loaded = load_model(path, torch.float32)
    hf = hf_causal_lm(path, torch.float32)
    toks = torch.randint(3, 49152, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = hf_logits(hf, toks)
    builder = PagedBatchBuilder(block_size=16, num_blocks=8)
    kv = builder.new_kv_caches(loaded, torch.float32)
    # A 78-token prefill in two chunks then two decodes: positions past the llama3/yarn
    # original context of 64.
    for start, end in ((0, 40), (40, 78), (78, 79), (79, 80)):
        ids, positions, meta = builder.build([("S", toks[start:end], start)])
        with torch.inference_mode():
            logits = loaded.model.compute_logits(loaded.model(ids, positions, kv, meta))
        torch.testing.assert_close(logits, expected[start:end], atol=1e-4, rtol=1e-4)
