"""Tiny random-weight HF model folders for the tests and benches (`python -m
testing.tiny_model OUT` writes one from the command line).

Built with transformers' own model classes so HF can serve as the reference, and paired
with the SmolLM2 tokenizer so token ids and text round-trip like the real model."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")

_COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
               rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
               pad_token_id=2, initializer_range=0.05)
# Per-pair LongRoPE factors for a rotated dim of 12 (head_dim 16, partial_rotary_factor
# 0.75): distinct per pair and between the sets, so a wrong set or order shows.
_SHORT_FACTORS = [1.0, 1.05, 1.1, 1.3, 1.6, 2.0]
_LONG_FACTORS = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]
_ARCH_DEFAULTS = {
    # Llama keeps a separate lm_head and Qwen2 ties it, so both paths get exercised.
    "llama": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    # MistralConfig's default window (4096) is past these models' positions: no effect.
    "mistral": dict(tie_word_embeddings=False),
    # Every layer windowed, the window shorter than the tests' prompts.
    "mistral-window": dict(tie_word_embeddings=False, sliding_window=12),
    # head_dim set apart from hidden_size / heads (q is 128 wide over a 64 hidden).
    "qwen3": dict(tie_word_embeddings=True, head_dim=32),
    # Caps and the query scalar small enough to matter at these weights' scale (real
    # Gemma 2: 50 and 30, query_pre_attn_scalar = head_dim); layers alternate windowed
    # (even) and full.
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=12, sliding_window=10,
                   attn_logit_softcapping=0.5, final_logit_softcapping=3.0),
    # Windowed, full, windowed (sliding_window_pattern works at every transformers
    # version; layer_types only from 4.53); the local layers' RoPE base apart from the
    # global one, and the global one linearly scaled, so each table has to be right.
    "gemma3": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=10,
                   sliding_window_pattern=2, num_hidden_layers=3, rope_theta=10000.0,
                   rope_local_base_freq=100.0,
                   rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "phi3": dict(tie_word_embeddings=False),
    # LongRoPE switching at position 64 of 256, over a partial rotary (12 of 16 dims).
    "phi3-longrope": dict(tie_word_embeddings=False, max_position_embeddings=256,
                          original_max_position_embeddings=64, partial_rotary_factor=0.75,
                          rope_scaling={"type": "longrope", "short_factor": _SHORT_FACTORS,
                                        "long_factor": _LONG_FACTORS}),
    # 8 experts, top 2: a short prompt already leaves some experts without a token.
    "mixtral": dict(tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=32),
    # Layer 0 MoE, layer 1 dense (mlp_only_layers) with its own intermediate_size; the k
    # routing weights left unnormalised (HF's default, not the real 30B-A3B's).
    "qwen3-moe": dict(tie_word_embeddings=False, head_dim=32, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                      mlp_only_layers=[1], norm_topk_prob=False),
    # 8 experts, top 2; windowed, full, windowed (layer_types' default alternation) with
    # a window shorter than the tests' prompts; YaRN stretching the wavelengths past 64
    # positions 4x (real gpt-oss: 32x past 4,096), its cos/sin scaled by 1.14.
    "gpt-oss": dict(tie_word_embeddings=False, head_dim=16, num_hidden_layers=3,
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                    sliding_window=12, max_position_embeddings=256,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False,
                                  "original_max_position_embeddings": 64}),
}


# arch -> the transformers class names of its config and causal LM. Names, looked up for the
# one arch asked: a class newer than the installed transformers (gpt-oss needs 4.55, the
# floor is 4.53) fails only the tests that build that arch.
_HF_CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral",
               "mistral-window": "Mistral", "qwen3": "Qwen3", "gemma2": "Gemma2",
               # Text-only Gemma 3 (model_type gemma3_text), as google/gemma-3-1b ships.
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
               "phi3": "Phi3", "phi3-longrope": "Phi3", "mixtral": "Mixtral",
               "qwen3-moe": "Qwen3Moe", "gpt-oss": "GptOss"}


def _hf_classes(arch: str):
    import transformers as tf
    names = _HF_CLASSES[arch]
    config, model = (names if isinstance(names, tuple)
                     else (f"{names}Config", f"{names}ForCausalLM"))
    return getattr(tf, config), getattr(tf, model)


def tiny_config(arch: str = "llama", **overrides: Any):
    """The HF config make_tiny_model_dir builds for `arch` (architectures set, as a
    saved folder's config has it)."""
    if arch not in _ARCH_DEFAULTS:
        raise ValueError(f"arch: expected one of {sorted(_ARCH_DEFAULTS)}, got {arch!r}")
    config_cls, model_cls = _hf_classes(arch)
    config = config_cls(**{**_COMMON, **_ARCH_DEFAULTS[arch], **overrides})
    config.architectures = [model_cls.__name__]
    return config


def make_tiny_model_dir(path: str | Path, arch: str = "llama", seed: int = 0,
                        tokenizer_dir: str | Path | None = None, **overrides: Any) -> Path:
    """Write a tiny random HF model (config, safetensors, tokenizer) to `path` and return it.

    `overrides` go to the HF config (e.g. num_hidden_layers=3, rope_scaling={...})."""
    config = tiny_config(arch, **overrides)
    model_cls = _hf_classes(arch)[1]
    return write_random_model(lambda: model_cls(config), path, seed, tokenizer_dir)


def write_random_model(build, path: str | Path, seed: int = 0,
                       tokenizer_dir: str | Path | None = None) -> Path:
    """`build()`'s model (HF's random init under `seed`, norms and biases perturbed),
    saved to `path` with the SmolLM2 tokenizer (or `tokenizer_dir`'s); returns `path`."""
    import torch

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = build().float().eval()
        std = model.config.initializer_range
        with torch.no_grad():
            for name, param in model.named_parameters():
                # HF initialises biases to 0 and norms to 1 (Gemma's to 0, applied as
                # 1 + w), which would hide a loader that drops them; perturb both so
                # tests can tell.
                if name.endswith("bias"):
                    param.normal_(0.0, std)
                elif "norm" in name:
                    param.add_(torch.randn_like(param) * 0.1)
                elif name.endswith("sinks"):
                    # gpt-oss's per-head attention sinks: HF draws them as small as the
                    # weights; at the logits' scale instead, so each head's matters.
                    param.normal_(0.0, 1.0)
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
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-weight HF model folder.")
    parser.add_argument("out", help="output folder")
    parser.add_argument("--arch", choices=sorted(_ARCH_DEFAULTS), default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="config override, e.g. --set num_hidden_layers=4")
    args = parser.parse_args(argv)
    print(make_tiny_model_dir(args.out, args.arch, args.seed, **parse_overrides(args.set)))


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """--set KEY=JSON items -> config overrides (a value that is not JSON stays a string)."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set: expected KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


if __name__ == "__main__":
    main()
