"""An HF folder -> a GGUF file llama.cpp loads (F32, BF16, Q8_0, Q4_0 or Q4_1): the family's
metadata, the byte-level BPE tokenizer, and the weights in llama.cpp's layout, for Llama,
Qwen3, Gemma 2, Gemma 3 (text), Phi-3, Mixtral and Qwen3-MoE (the per-family facts:
bench/gguf_arch.py).
A small counterpart of llama.cpp's convert_hf_to_gguf.py for the folders
bench/make_model.py and testing/ write (needs gguf, numpy, safetensors and torch; not the engine).

  python -m bench.gguf_from_hf HF_DIR OUT.gguf --type q8_0

As llama.cpp's converter does it: tensors are named by the gguf package's TensorNameMap
(Phi-3's fused qkv_proj and gate_up_proj stay fused, as attn_qkv and ffn_up), Llama's q and
k rows are permuted per head for llama.cpp's interleaved RoPE, Gemma's norms are stored as
1 + w, 1-D tensors (the norms) and MoE routers (ffn_gate_inp) stay F32 whatever the type,
each layer's experts are stacked into one [experts, out, in] tensor per projection
(ffn_gate_exps, ffn_up_exps, ffn_down_exps; quantized row by row), a tied lm_head is left out
(llama.cpp reads token_embd instead), llama3 rope scaling travels as the rope_freqs tensor
and Phi-3's longrope as rope_factors_long/short. Unlike llama-quantize, every matrix,
token_embd included, gets the one type asked for (F16 where its rows do not split into
32-value blocks, as llama.cpp falls back): the gguf package has no Q6_K quantizer, and one
type per file keeps the comparison plain.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_VERSION, MODEL_ARCH_NAMES, GGUFWriter, LlamaFileType, TokenType
from gguf import GGMLQuantizationType as QT
from gguf import GGML_QUANT_SIZES, MODEL_TENSOR, TENSOR_NAMES, get_tensor_name_map
from gguf.quants import quant_shape_to_byte_shape, quantize

from bench.gguf_arch import Family, family_for, llama3_rope_factors  # noqa: F401 (re-exported)
from bench.gguf_arch import kv_heads

TYPES = {"f32": (QT.F32, LlamaFileType.ALL_F32), "bf16": (QT.BF16, LlamaFileType.MOSTLY_BF16),
         "q8_0": (QT.Q8_0, LlamaFileType.MOSTLY_Q8_0), "q4_0": (QT.Q4_0, LlamaFileType.MOSTLY_Q4_0),
         "q4_1": (QT.Q4_1, LlamaFileType.MOSTLY_Q4_1)}
_ROWS_PER_CHUNK = 4096  # quantize this many rows at a time: numpy's temporaries stay small
_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")
# HF's per-expert tensors (Mixtral's block_sparse_moe.experts.3.w1, Qwen3-MoE's
# mlp.experts.3.gate_proj): the TensorNameMap names their stack, the index left out.
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")
_ROUTER = f".{TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_INP].rpartition('.')[2]}.weight"


def permute_heads(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half row order -> llama.cpp's interleaved one, within each head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _order(hf_name: str) -> tuple:
    """Embedding first, then layer by layer, then the rest (file order; readers do not care)."""
    layer = _LAYER_RE.search(hf_name)
    if layer:
        return (1, int(layer.group(1)), hf_name)
    return (0 if "embed_tokens" in hf_name else 2, 0, hf_name)


def _plan(model_dir: Path, config: dict, family: Family
          ) -> list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]:
    """(GGUF name, numpy shape, loader of the float32 values) for every tensor, in file
    order; loading waits until the tensor is written, so one tensor is in memory at a time."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors")
    handles = {}
    for f in files:
        handle = safe_open(str(f), framework="pt")
        handles.update({name: handle for name in handle.keys()})
    names = get_tensor_name_map(family.arch, config["num_hidden_layers"])
    heads = {"attn_q": config["num_attention_heads"], "attn_k": kv_heads(config)}
    tied = bool(config.get("tie_word_embeddings", False))
    # Each layer's experts of one projection become one tensor, stacked along a new first
    # axis in expert order (llama.cpp's converter: torch.stack), planned where expert 0 sorts.
    num_experts = config.get("num_local_experts") or config.get("num_experts") or 0
    stacks: dict[str, dict[int, str]] = {}
    for hf_name in handles:
        expert = _EXPERT_RE.search(hf_name)
        if expert:
            stacked = _EXPERT_RE.sub(".experts.", hf_name, count=1)
            stacks.setdefault(stacked, {})[int(expert.group(1))] = hf_name
    for stacked, members in stacks.items():
        if sorted(members) != list(range(num_experts)):
            raise ValueError(f"{stacked}: the checkpoint has experts {sorted(members)}, the "
                             f"config {num_experts}")
    plan = []
    for hf_name in sorted(handles, key=_order):
        if hf_name == "lm_head.weight" and (tied or family.drop_lm_head):
            continue  # llama.cpp reads token_embd as the output
        expert = _EXPERT_RE.search(hf_name)
        if expert and expert.group(1) != "0":
            continue  # in expert 0's stack
        stacked = _EXPERT_RE.sub(".experts.", hf_name, count=1) if expert else hf_name
        base, _, suffix = stacked.rpartition(".")
        gguf_base = names.get_name(base)
        if gguf_base is None:
            raise ValueError(f"{hf_name}: no GGUF name for {MODEL_ARCH_NAMES[family.arch]}")
        kind = gguf_base.rpartition(".")[2]
        permute = heads[kind] if family.permute_qk and kind in heads else 0
        shift = family.norm_shift if hf_name.endswith("norm.weight") else 0.0
        members = [stacks[stacked][e] for e in range(num_experts)] if expert else None

        def values(hf_name=hf_name, permute=permute, shift=shift, members=members) -> np.ndarray:
            if members is not None:
                return np.stack([handles[m].get_tensor(m).float().numpy() for m in members])
            w = handles[hf_name].get_tensor(hf_name).float().numpy()
            w = permute_heads(w, permute) if permute else w
            return w + np.float32(shift) if shift else w  # float32 sum, as llama.cpp's

        shape = tuple(handles[hf_name].get_slice(hf_name).get_shape())
        plan.append((f"{gguf_base}.{suffix}", (num_experts, *shape) if expert else shape, values))
    for tensor, value in family.extra(config):
        plan.append((tensor, value.shape, lambda value=value: value))
    return plan


def _tensor_type(name: str, shape: tuple[int, ...], qtype: QT) -> QT:
    # A MoE router stays F32 in llama.cpp's converter and llama-quantize alike.
    if len(shape) == 1 or name.endswith(_ROUTER):
        return QT.F32
    if qtype in (QT.F32, QT.BF16):
        return qtype
    block, _ = GGML_QUANT_SIZES[qtype]
    # Rows that do not split into blocks: F16, llama.cpp's converter's fallback.
    return qtype if shape[-1] % block == 0 else QT.F16


def _encode(values: np.ndarray, qtype: QT) -> np.ndarray:
    if qtype in (QT.F32, QT.F16):
        return values.astype(np.float32 if qtype == QT.F32 else np.float16, copy=False)
    rows = values.reshape(-1, values.shape[-1])  # stacked experts: every expert's rows
    blocks = np.concatenate([quantize(rows[i:i + _ROWS_PER_CHUNK], qtype)
                             for i in range(0, rows.shape[0], _ROWS_PER_CHUNK)])
    return blocks.reshape(*values.shape[:-1], blocks.shape[-1])


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
    family = family_for(config)
    qtype, file_type = TYPES[kind]
    plan = _plan(model_dir, config, family)  # refuses what has no GGUF form before writing
    w = GGUFWriter(out, MODEL_ARCH_NAMES[family.arch])
    w.add_name(name or model_dir.name)
    family.metadata(w, config)
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

    types = [_tensor_type(tensor, shape, qtype) for tensor, shape, _ in plan]
    # Tensor infos first, data after: each tensor is read, encoded and written in turn.
    for (tensor, shape, _), t in zip(plan, types):
        if t in (QT.F32, QT.F16):
            dtype = np.dtype(np.float32 if t == QT.F32 else np.float16)
            w.add_tensor_info(tensor, shape, dtype, dtype.itemsize * math.prod(shape))
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
