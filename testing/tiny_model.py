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
_ARCH_DEFAULTS = {
    # Llama keeps a separate lm_head and Qwen2 ties it, so both paths get exercised.
    "llama": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "mistral": dict(tie_word_embeddings=False),
}


def _hf_classes(arch: str):
    import transformers as tf
    return {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[arch]


def make_tiny_model_dir(path: str | Path, arch: str = "llama", seed: int = 0,
                        tokenizer_dir: str | Path | None = None, **overrides: Any) -> Path:
    """Write a tiny random HF model (config, safetensors, tokenizer) to `path` and return it.

    `overrides` go to the HF config (e.g. num_hidden_layers=3, rope_scaling={...})."""
    import torch

    if arch not in _ARCH_DEFAULTS:
        raise ValueError(f"arch: expected one of {sorted(_ARCH_DEFAULTS)}, got {arch!r}")
    config_cls, model_cls = _hf_classes(arch)
    config = config_cls(**{**_COMMON, **_ARCH_DEFAULTS[arch], **overrides})
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = model_cls(config).float().eval()
        std = config.initializer_range
        with torch.no_grad():
            for name, param in model.named_parameters():
                # HF initialises biases to 0 and norms to 1, which would hide a loader that
                # drops them; perturb both so tests can tell.
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
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set: expected KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    print(make_tiny_model_dir(args.out, args.arch, args.seed, **overrides))


if __name__ == "__main__":
    main()
