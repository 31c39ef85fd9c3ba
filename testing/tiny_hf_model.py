"""Tiny random-weight HF folders for any transformers causal LM (the general path's tests
and bench): `make_tiny_hf_dir(out, "olmo2")` writes one through transformers' own config
and model classes, with the SmolLM2 tokenizer so ids and text round-trip as with the real
model (`python -m testing.tiny_hf_model OUT --model-type olmo2` from the command line).

testing/tiny_model.py does the same for the natively implemented families."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from testing.tiny_model import parse_overrides, write_random_model

# The same sizes as testing/tiny_model.py: small enough to build in milliseconds, a real
# vocabulary so the tokenizer's ids are all in range.
_COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
               rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2,
               initializer_range=0.05)

# Per model type, what makes the family differ from Llama switched on (and off the
# defaults that would make a tiny test pass by accident).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(tie_word_embeddings=False, rms_norm_eps=1e-5),
    # q/k RMSNorm over all heads, norms after attention and MLP.
    "olmo2": dict(tie_word_embeddings=False, rms_norm_eps=1e-5),
    # Every multiplier away from 1, logits divided by logits_scaling.
    "granite": dict(tie_word_embeddings=False, rms_norm_eps=1e-5, embedding_multiplier=3.0,
                    residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
    # Partial rotary (a quarter of each head), LayerNorm, parallel residual, fused QKV
    # and its own lm_head name (embed_out) under its own base prefix (gpt_neox).
    "gpt_neox": dict(tie_word_embeddings=False, rotary_pct=0.25, use_parallel_residual=True,
                     layer_norm_eps=1e-5, attention_bias=True),
    # Partial rotary, LayerNorm, biases everywhere, attention and MLP in parallel.
    "phi": dict(tie_word_embeddings=False, partial_rotary_factor=0.5, layer_norm_eps=1e-5,
                hidden_act="gelu_new"),
    # Tied embeddings, logits scaled (logit_scale), interleaved rotary, q/k LayerNorm.
    "cohere": dict(tie_word_embeddings=True, logit_scale=0.5, use_qk_norm=True,
                   layer_norm_eps=1e-5),
    # Sliding window on every other layer, attention and final logit soft-capping,
    # query_pre_attn_scalar for the scale.
    "gemma2": dict(tie_word_embeddings=True, head_dim=16, sliding_window=6,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                   query_pre_attn_scalar=24, rms_norm_eps=1e-6),
}


def make_tiny_hf_dir(path: str | Path, model_type: str, seed: int = 0,
                     tokenizer_dir: str | Path | None = None, **overrides: Any) -> Path:
    """Write a tiny random `model_type` causal LM (config, safetensors, tokenizer) to
    `path` and return it. `overrides` go to the config; keys the config class does not
    know are kept on it, as HF keeps them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    known = AutoConfig.for_model(model_type).to_dict()
    # A common size the family has no field for (GPT-NeoX has no num_key_value_heads)
    # would stay on the config as a stray attribute that readers take for the real one.
    common = {k: v for k, v in _COMMON.items() if k in known}
    config = AutoConfig.for_model(model_type, **{**common, **_DEFAULTS.get(model_type, {}),
                                                 **overrides})
    return write_random_model(lambda: _with_architecture(AutoModelForCausalLM.from_config(config)),
                              path, seed, tokenizer_dir)


def _with_architecture(model):
    model.config.architectures = [type(model).__name__]
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-weight HF causal LM folder.")
    parser.add_argument("out", help="output folder")
    parser.add_argument("--model-type", default="olmo2",
                        help="a transformers model_type (e.g. olmo2, granite, gpt_neox, phi)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="config override, e.g. --set num_hidden_layers=4")
    args = parser.parse_args(argv)
    print(make_tiny_hf_dir(args.out, args.model_type, args.seed, **parse_overrides(args.set)))


if __name__ == "__main__":
    main()
