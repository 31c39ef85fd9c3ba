"""An HF Llama folder -> a GGUF file llama.cpp loads (F32, BF16, Q8_0 or Q4_0): the llama
architecture metadata, the byte-level BPE tokenizer, and the weights in llama.cpp's layout.
A small counterpart of llama.cpp's convert_hf_to_gguf.py for the folders
bench/make_model.py writes (needs gguf, numpy, safetensors and torch; not the engine).

  python -m bench.gguf_from_hf HF_DIR OUT.gguf --type q8_0

As llama.cpp's converter does it: q and k rows are permuted per head for llama.cpp's
interleaved RoPE, 1-D tensors (the norms) stay F32 whatever the type, a tied lm_head is
left out (llama.cpp reads token_embd instead), and llama3 rope scaling travels as the
rope_freqs tensor (llama.cpp divides each frequency by it). Unlike llama-quantize, every
matrix, token_embd included, gets the one type asked for: the gguf package has no Q6_K
quantizer, and one type per file keeps the comparison plain.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_VERSION, GGUFWriter, LlamaFileType, TokenType
from gguf import GGMLQuantizationType as QT
from gguf.quants import quant_shape_to_byte_shape, quantize

TYPES = {"f32": (QT.F32, LlamaFileType.ALL_F32), "bf16": (QT.BF16, LlamaFileType.MOSTLY_BF16),
         "q8_0": (QT.Q8_0, LlamaFileType.MOSTLY_Q8_0), "q4_0": (QT.Q4_0, LlamaFileType.MOSTLY_Q4_0)}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_ROWS_PER_CHUNK = 4096  # quantize this many rows at a time: numpy's temporaries stay small


def permute_heads(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half row order -> llama.cpp's interleaved one, within each head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config: dict) -> np.ndarray:
    """What llama.cpp divides each base frequency by for HF's llama3 rope_scaling."""
    s, dim = config["rope_scaling"], _head_dim(config)
    base = 1.0 / config.get("rope_theta", 10000.0) ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for freq in base:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _plan(model_dir: Path, config: dict) -> list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """(GGUF name, numpy shape, loader of the float32 values) for every tensor, in file
    order; loading waits until the tensor is written, so one tensor is in memory at a time."""
    from safetensors import safe_open

    handle = safe_open(str(next(model_dir.glob("*.safetensors"))), framework="pt")

    def load(hf_name: str, heads: int = 0) -> Callable[[], np.ndarray]:
        def values() -> np.ndarray:
            w = handle.get_tensor(hf_name).float().numpy()
            return permute_heads(w, heads) if heads else w
        return values

    def shape(hf_name: str) -> tuple[int, ...]:
        return tuple(handle.get_slice(hf_name).get_shape())

    plan = [("token_embd.weight", shape("model.embed_tokens.weight"), load("model.embed_tokens.weight"))]
    for i in range(config["num_hidden_layers"]):
        for hf, ours in _LAYER.items():
            name = f"model.layers.{i}.{hf}.weight"
            heads = {"attn_q": config["num_attention_heads"],
                     "attn_k": config.get("num_key_value_heads") or config["num_attention_heads"]}
            plan.append((f"blk.{i}.{ours}.weight", shape(name), load(name, heads.get(ours, 0))))
    plan.append(("output_norm.weight", shape("model.norm.weight"), load("model.norm.weight")))
    if not config.get("tie_word_embeddings", False):
        plan.append(("output.weight", shape("lm_head.weight"), load("lm_head.weight")))
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factors = llama3_rope_factors(config)
        plan.append(("rope_freqs.weight", factors.shape, lambda: factors))
    elif scaling:
        raise ValueError(f"rope_scaling {scaling} has no GGUF form here (llama3 only)")
    return plan


def _encode(values: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype == QT.F32:
        return values.astype(np.float32, copy=False)
    return np.concatenate([quantize(values[i:i + _ROWS_PER_CHUNK], qtype)
                           for i in range(0, values.shape[0], _ROWS_PER_CHUNK)])


def _tokenizer(model_dir: Path) -> Iterator[tuple[str, object]]:
    """(GGUF tokenizer key suffix, value) pairs for a byte-level BPE tokenizer.json."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    pre = tok.get("pre_tokenizer") or {}
    if tok["model"]["type"] != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ValueError("tokenizer: only a byte-level BPE with GPT-2's split is converted here")
    vocab = tok["model"]["vocab"]
    added = {a["id"]: a for a in tok["added_tokens"]}
    size = 1 + max([*vocab.values(), *added])
    tokens, types = [f"[PAD{i}]" for i in range(size)], [int(TokenType.UNUSED)] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, int(TokenType.NORMAL)
    for i, a in added.items():
        tokens[i] = a["content"]
        types[i] = int(TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    # llama.cpp's "gpt-2" pre-tokenizer is GPT-2's regex, the one ByteLevel(use_regex) applies.
    yield from (("model", "gpt2"), ("pre", "gpt-2"), ("tokens", tokens), ("types", types),
                ("merges", merges))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    yield "add_bos", bool(config.get("add_bos_token", False))
    template = model_dir / "chat_template.jinja"
    chat = template.read_text() if template.is_file() else config.get("chat_template")
    if chat:
        yield "chat_template", chat
    specials = model_dir / "special_tokens_map.json"
    unk = json.loads(specials.read_text()).get("unk_token") if specials.is_file() else None
    if isinstance(unk, str) and unk in tokens:
        yield "unk", tokens.index(unk)


def write_gguf(model_dir: str | Path, out: str | Path, kind: str = "bf16", name: str = "") -> Path:
    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"model_type {config.get('model_type')!r}: only llama is converted here")
    qtype, file_type = TYPES[kind]
    w = GGUFWriter(out, "llama")
    w.add_name(name or model_dir.name)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    w.add_key_length(_head_dim(config))
    w.add_value_length(_head_dim(config))
    w.add_rope_dimension_count(_head_dim(config))
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_file_type(int(file_type))
    if qtype not in (QT.F32, QT.BF16):
        w.add_quantization_version(GGML_QUANT_VERSION)
    tokenizer = dict(_tokenizer(model_dir))
    if len(tokenizer["tokens"]) != config["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tokenizer['tokens'])} ids, config.vocab_size "
                         f"{config['vocab_size']}: llama.cpp sizes the vocabulary by the tokenizer")
    w.add_tokenizer_model(tokenizer["model"])
    w.add_tokenizer_pre(tokenizer["pre"])
    w.add_token_list(tokenizer["tokens"])
    w.add_token_types(tokenizer["types"])
    w.add_token_merges(tokenizer["merges"])
    w.add_add_bos_token(tokenizer["add_bos"])
    if "chat_template" in tokenizer:
        w.add_chat_template(tokenizer["chat_template"])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("pad_token_id", w.add_pad_token_id)):
        if isinstance(config.get(key), int):
            add(config[key])
    if "unk" in tokenizer:
        w.add_unk_token_id(tokenizer["unk"])

    plan = _plan(model_dir, config)
    types = [QT.F32 if len(shape) == 1 else qtype for _, shape, _ in plan]
    # Tensor infos first, data after: each tensor is read, encoded and written in turn.
    for (tensor, shape, _), t in zip(plan, types):
        if t == QT.F32:
            w.add_tensor_info(tensor, shape, np.dtype(np.float32), 4 * math.prod(shape))
        else:
            byte_shape = quant_shape_to_byte_shape(shape, t)
            w.add_tensor_info(tensor, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for (_, _, values), t in zip(plan, types):
        w.write_tensor_data(_encode(values(), t))
    w.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--type", choices=sorted(TYPES), default="bf16")
    args = ap.parse_args()
    print(write_gguf(args.model_dir, args.out, args.type))


if __name__ == "__main__":
    main()
