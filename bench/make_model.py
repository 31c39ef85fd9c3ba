"""A random-weight model of a real model's shape (Llama, Qwen3, Gemma 3 text, and the
mixture-of-experts Qwen3-MoE and Mixtral), as an HF folder plus GGUF files of the same
weights (bench/gguf_arch.py's llama.cpp layouts, experts stacked per layer for the MoE
shapes), so the engine, vLLM and llama.cpp all run one model
(bench_generate --model DIR --gguf DIR/gguf/*.gguf).
Nothing is downloaded: the tokenizer is the embedded SmolLM2 one, its vocabulary padded
with unreachable "[PAD<id>]" entries up to the shape's vocab_size, so every id the model
can emit decodes on every side.

  python -m bench.make_model --shape llama-3.2-1b --out /tmp/llama-1b   # + BF16, Q8_0, Q4_0
  python -m bench.make_model --shape tiny --out /tmp/tiny --gguf f32 q8_0
  python -m bench.make_model --shape qwen3-0.6b --out /tmp/qwen3 --gguf    # HF folder only
  python -m bench.make_model --shape qwen3-30b-a3b --layers 4 --out /tmp/moe  # 4 of 48 layers

Writes OUT/config.json, generation_config.json, model.safetensors (bf16), the tokenizer
files, and OUT/gguf/<shape>-<TYPE>.gguf (bench/gguf_from_hf.py; a subfolder, so no loader
mistakes a GGUF for the folder's checkpoint). The same --seed gives the same weights.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.gguf_from_hf import TYPES, write_gguf

# Llama-3.2-1B's config.json rope_scaling: the engine implements the llama3 rule, and
# llama.cpp gets it as the rope_freqs tensor (gguf_from_hf.py).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_QWEN3 = dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
              vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=True)

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=True),
    # Qwen3's published configs (0.6B / 1.7B): q/k norms, head_dim 128 apart from hidden.
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144),
    # Gemma-3-1B's: five 512-token sliding-window layers to each global one, head_dim 256.
    "gemma-3-1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                       vocab_size=262144, max_position_embeddings=32768, rope_theta=1000000.0,
                       rope_local_base_freq=10000.0, rope_scaling=None, sliding_window=512,
                       sliding_window_pattern=6, query_pre_attn_scalar=256,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
    # Qwen3-30B-A3B's config.json: 128 experts of 768, top 8 renormalised, every layer MoE
    # (its intermediate_size is a dense MLP's no layer has). ~61 GB in bf16: cut it with
    # --layers (each layer ~1.2 GB of experts).
    "qwen3-30b-a3b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_window_layers=48),
    # Mixtral-8x7B's, except the vocabulary: 49152, not its 32000, which is below the
    # embedded tokenizer's ids (write_tokenizer can pad a vocabulary, not cut one).
    "mixtral-8x7b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         vocab_size=49152, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, num_local_experts=8,
                         num_experts_per_tok=2, sliding_window=None),
    # The same layout scaled down; 128 padding ids so the tests cover the padded vocabulary,
    # and head_dim 16 still puts rotary frequencies in all three llama3 bands.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=49152 + 128, max_position_embeddings=16384, rope_theta=500000.0,
                 rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=True),
}
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
INIT_STD = 0.02  # HF's initializer_range for Llama: the embedding's (see random_weights)


def family_of(shape: str) -> str:
    if shape.startswith("qwen3"):
        return "qwen3_moe" if "num_experts" in SHAPES[shape] else "qwen3"
    return "gemma3" if shape.startswith("gemma-3") else "mixtral" if shape.startswith("mixtral") \
        else "llama"


def config_for(shape: str, tokenizer_src: Path, layers: int | None = None) -> dict:
    """The shape's config.json; `layers`: only the first that many decoder layers."""
    # bos/eos are the tokenizer's (SmolLM2's 1 and 2), not Llama-3's 128000/128001.
    ids = json.loads((tokenizer_src / "config.json").read_text())
    special = {k: ids[k] for k in ("bos_token_id", "eos_token_id") if ids.get(k) is not None}
    common = {"attention_bias": False, "attention_dropout": 0.0,
              "initializer_range": INIT_STD, "use_cache": True, "torch_dtype": "bfloat16",
              **special, **SHAPES[shape],
              **({"num_hidden_layers": layers} if layers else {}),
              # Llama-3.2-1B's own value. Without one, transformers 4.57 takes a local folder
              # for a Mistral one and warns, on every load, that its tokenizer regex is wrong.
              "transformers_version": "4.45.0.dev0"}
    family = family_of(shape)
    if family == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
                **common}
    if family == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
                **common}
    if family == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "hidden_act": "silu", **common}
    if family == "gemma3":
        pattern = common["sliding_window_pattern"]
        # layer_types spelled out too: transformers >= 4.53 reads it, older ones the pattern.
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(common["num_hidden_layers"])]
        return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
                "attn_logit_softcapping": None, "layer_types": kinds, **common}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "mlp_bias": False, "pretraining_tp": 1, **common}


def weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """HF checkpoint names -> shapes, in the order the RNG fills them: reordering them
    would change the weights a seed gives."""
    h, q = c["hidden_size"], c["num_attention_heads"] * c["head_dim"]
    kv, inter = c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    family = c.get("model_type", "llama")  # a bare SHAPES entry is a Llama
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,)})
        shapes.update(_feed_forward_shapes(c, i, p))
        if family in ("qwen3", "qwen3_moe", "gemma3_text"):  # per-head norms of q and k
            shapes.update({p + "self_attn.q_norm.weight": (c["head_dim"],),
                           p + "self_attn.k_norm.weight": (c["head_dim"],)})
        if family == "gemma3_text":  # norms after attention and around the MLP
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,),
                           p + "post_feedforward_layernorm.weight": (h,)})
    shapes["model.norm.weight"] = (h,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    return shapes


def _feed_forward_shapes(c: dict, layer: int, p: str) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s MLP, or its router and experts (HF's names and order) where the
    family makes it a mixture of experts (HF's rule for Qwen3-MoE's layers)."""
    from engine.models.qwen3_moe import is_moe_layer

    h, family = c["hidden_size"], c.get("model_type", "llama")
    if family == "mixtral":
        block, parts, num_experts, inter = ("block_sparse_moe", ("w1", "w2", "w3"),
                                            c["num_local_experts"], c["intermediate_size"])
    elif family == "qwen3_moe" and is_moe_layer(SimpleNamespace(**c), layer):
        block, parts, num_experts, inter = ("mlp", ("gate_proj", "up_proj", "down_proj"),
                                            c["num_experts"], c["moe_intermediate_size"])
    else:
        inter = c["intermediate_size"]
        return {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter)}
    shapes = {f"{p}{block}.gate.weight": (num_experts, h)}
    for e in range(num_experts):
        for part in parts:
            down = part in ("w2", "down_proj")
            shapes[f"{p}{block}.experts.{e}.{part}.weight"] = (h, inter) if down else (inter, h)
    return shapes


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Matrices N(0, 1/fan_in), so every projection keeps its input's scale (at 2048 wide
    that is HF's 0.02) and each layer adds to the residual stream about as much as the
    embedding row holds; the logits then follow the context. With HF's flat 0.02 a narrow
    model's layers add almost nothing, and a tied table's own row wins: greedy output
    repeats the prompt's last token. The embedding keeps 0.02. Norm weights are 1 +- 0.1,
    not HF's exact ones, so a loader that dropped them would change the output."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        noise = torch.randn(shape, generator=g)
        if name.endswith("norm.weight"):
            # Gemma stores w and scales by (1 + w): the same 1 +- 0.1 either way.
            w = (0.0 if config.get("model_type") == "gemma3_text" else 1.0) + 0.1 * noise
        else:
            w = noise * (INIT_STD if "embed_tokens" in name else shape[1] ** -0.5)
        weights[name] = w.to(torch.bfloat16)
    return weights


def write_tokenizer(out: Path, vocab_size: int, src: Path) -> None:
    """src's tokenizer with vocab_size entries: the padding ids go into the BPE vocabulary
    itself (no merge produces them, so encoding is unchanged), not as added tokens, which
    the tokenizer would scan every text for."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    size = 1 + max([*vocab.values(), *(a["id"] for a in tok["added_tokens"])])
    if vocab_size < size:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {size} ids; "
                         "a BPE vocabulary cannot be cut without breaking its merges")
    vocab.update({f"[PAD{i}]": i for i in range(size, vocab_size)})
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))


def make_model(shape: str, out: str | Path, seed: int = 0, gguf: tuple[str, ...] = (),
               tokenizer_src: str | Path | None = None, layers: int | None = None) -> Path:
    """Write the HF folder (and the requested GGUF types) to `out`; returns `out`.
    `layers`: the shape's first that many decoder layers only (a big MoE's folder is
    ~1.2 GB a layer)."""
    from safetensors.torch import save_file

    if tokenizer_src is None:
        from engine.models import default_model_dir
        tokenizer_src = default_model_dir()
    src, out = Path(tokenizer_src), Path(out)
    config = config_for(shape, src, layers)
    if gguf:
        from bench.gguf_arch import family_for
        family_for(config)  # refused before anything is written
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(out, config["vocab_size"], src)
    save_file(random_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    for kind in gguf:
        (out / "gguf").mkdir(exist_ok=True)
        write_gguf(out, out / "gguf" / f"{shape}-{kind.upper()}.gguf", kind, name=f"random {shape}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True, help="the HF folder to write (created)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf", nargs="*", choices=sorted(TYPES), default=None,
                    help="GGUF files of the same weights to write under OUT/gguf/ (none: --gguf; "
                         "default bf16 q8_0 q4_0, none for the MoE shapes)")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only the shape's first LAYERS decoder layers")
    args = ap.parse_args()
    gguf = args.gguf
    if gguf is None:
        gguf = ["bf16", "q8_0", "q4_0"]
    if args.layers is not None and args.layers < 1:
        ap.error("--layers: at least 1")
    out = make_model(args.shape, args.out, args.seed, tuple(gguf), layers=args.layers)
    for path in [out, *sorted((out / "gguf").glob("*.gguf"))]:
        print(path)


if __name__ == "__main__":
    main()
