"""bench/make_model.py's Qwen3 and Gemma 3 shapes: HF transformers builds the same tensors
from the config it writes (on the meta device: no memory), and a scaled-down folder of
each family is read by transformers with every tensor used."""
import json

import pytest
import torch

from bench.make_model import SHAPES, config_for, random_weights, weight_shapes
from engine.models import default_model_dir

FAMILY_SHAPES = ["qwen3-0.6b", "qwen3-1.7b", "gemma-3-1b"]


def _hf_model_on_meta(config: dict):
    import transformers
    hf_config = transformers.AutoConfig.for_model(
        **{k: v for k, v in config.items() if k != "transformers_version"})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config)


@pytest.mark.parametrize("shape", FAMILY_SHAPES)
def test_shapes_are_what_transformers_builds_from_the_config(shape):
    config = config_for(shape, default_model_dir())
    model = _hf_model_on_meta(config)
    assert type(model).__name__ == config["architectures"][0]
    hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = weight_shapes(config)
    if config["tie_word_embeddings"]:
        hf.pop("lm_head.weight")
    assert ours == hf


def test_gemma_norms_are_stored_around_zero():
    # Gemma scales by (1 + w): weights around 1 would double every norm.
    config = config_for("gemma-3-1b", default_model_dir())
    config = {**config, **dict(num_hidden_layers=1, vocab_size=64, hidden_size=32,
                               intermediate_size=64, head_dim=16)}
    weights = random_weights(config, seed=0)
    norms = [w.float() for name, w in weights.items() if name.endswith("norm.weight")]
    assert len(norms) == 7  # input, post-attention, pre/post-feedforward, q, k; the final one
    assert all(abs(float(w.mean())) < 0.1 for w in norms)


def test_gemma_layer_types_follow_the_pattern():
    config = config_for("gemma-3-1b", default_model_dir())
    kinds = config["layer_types"]
    assert kinds.count("full_attention") == 4 and len(kinds) == 26
    assert [i for i, k in enumerate(kinds) if k == "full_attention"] == [5, 11, 17, 23]
    json.dumps(config)  # what make_model writes
