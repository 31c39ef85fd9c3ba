"""Tiny random-weight HF folders for any transformers causal LM (the general path's tests
and bench): `make_tiny_hf_dir(out, "olmo2")` writes one through transformers' own config
and model classes, with the SmolLM2 tokenizer so ids and text round-trip as with the real
model (`python -m testing.tiny_hf_model OUT --model-type olmo2` from the command line).

testing/tiny_model.py does the same for the natively implemented families."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

# Tokenizer files copied beside the weights (those the SmolLM2 folder has).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")

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
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    known = AutoConfig.for_model(model_type).to_dict()
    # A common size the family has no field for (GPT-NeoX has no num_key_value_heads)
    # would stay on the config as a stray attribute that readers take for the real one.
    common = {k: v for k, v in _COMMON.items() if k in known}
    config = AutoConfig.for_model(model_type, **{**common, **_DEFAULTS.get(model_type, {}),
                                                 **overrides})
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config).float().eval()
        config.architectures = [type(model).__name__]
        std = config.initializer_range
        with torch.no_grad():
            for name, param in model.named_parameters():
                # HF starts biases at 0 and norms at 1 (0 for Gemma's offset norms),
                # which would hide a loader that drops them; perturb both.
                if name.endswith("bias"):
                    param.normal_(0.0, std)
                elif "norm" in name:
                    param.add_(torch.randn_like(param) * 0.1)
    finally:
        torch.random.set_rng_state(generator_state)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    _copy_tokenizer(Path(tokenizer_dir) if tokenizer_dir else None, out)
    return out


def _copy_tokenizer(src: Path | None, out: Path) -> None:
    if src is None:
        from engine.models import default_model_dir
        src = default_model_dir()
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-weight HF causal LM folder.")
    parser.add_argument("out", help="output folder")
    parser.add_argument("--model-type", default="olmo2",
                        help="a transformers model_type (e.g. olmo2, granite, gpt_neox, phi)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="config override, e.g. --set num_hidden_layers=4")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set: expected KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    print(make_tiny_hf_dir(args.out, args.model_type, args.seed, **overrides))


if __name__ == "__main__":
    main()
