"""The quantized tensors of a GGUF file, named and shaped for our Llama-family model
(quantization="gguf"): the weights stay in the file's blocks, see kernels/cpu/gguf_weight.py.

GGUF stores Llama's q and k projections with the rows of each head interleaved (llama.cpp's
converter permutes them for its RoPE); which order a file uses is read off the data: the
dequantized rows are compared with the dense weights loaded from the same file, both
orders tried. Tensors in formats the kernel lacks (F32, F16, K-quants) leave their layer
dense, and so does a fused layer whose parts differ in format.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import torch

from kernels.dispatch import GGUF_FORMATS, GgufWeight

logger = logging.getLogger(__name__)

# GGUF per-layer tensor -> (our module, position among the fused parts)
_LAYER_TENSORS = {"attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1),
                  "attn_v": ("self_attn.qkv_proj", 2), "attn_output": ("self_attn.o_proj", 0),
                  "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1),
                  "ffn_down": ("mlp.down_proj", 0)}


def _head_rows_order(num_heads: int, rows: int) -> torch.Tensor:
    """Index taking a permuted file's rows back to HF's order: within each head the file
    holds rows (i, half) at 2 i + half, HF at half * head_dim / 2 + i."""
    head_dim = rows // num_heads
    h = torch.arange(num_heads).view(-1, 1, 1) * head_dim
    half = torch.arange(2).view(1, -1, 1)
    i = torch.arange(head_dim // 2).view(1, 1, -1)
    return (h + 2 * i + half).reshape(-1)


def _matching_order(weight: GgufWeight, dense: torch.Tensor, num_heads: int,
                    name: str) -> GgufWeight:
    """The weight in HF's row order, whichever order the file used (decided on the first
    head's rows: dequantizing whole tables twice per layer would double the load time)."""
    head_dim = weight.out_features // num_heads
    dense = dense[:head_dim]
    # The dense copy was rounded to the model's dtype: round ours the same way, and allow
    # one unit in its last place where float32 rounding put a value on the other side of
    # a tie (bf16 alone is 2^-9 relative, past a fixed 1e-3 of the largest weight where
    # many weights sit near it, as in a Q4_0 file of random weights). The wrong order
    # misses by about the weights themselves.
    dtype = dense.dtype
    dense = dense.float()
    tolerance = 1e-3 * float(dense.abs().max()) + 1e-6 + torch.finfo(dtype).eps * dense.abs()
    permuted = _head_rows_order(num_heads, weight.out_features)
    for order in (None, permuted):
        first_head = weight.dequantize(None if order is None else order[:head_dim])[:head_dim]
        first_head = first_head.to(dtype).float()
        if bool(((first_head - dense).abs() <= tolerance).all()):
            return weight if order is None else weight.select_rows(order)
    raise ValueError(f"quantization: {name} in the GGUF file matches neither row order of "
                     "the dense weights loaded from it")


def _tensor(reader_tensor) -> tuple[str, GgufWeight] | None:
    type_name = reader_tensor.tensor_type.name
    if type_name not in GGUF_FORMATS:
        return None
    blocks = torch.from_numpy(np.array(reader_tensor.data, copy=True)).view(torch.uint8)
    in_features = int(reader_tensor.shape[0])  # GGUF lists dimensions innermost first
    return type_name, GgufWeight.from_blocks(type_name, blocks.reshape(blocks.shape[0], -1),
                                             in_features)


def read_quantized(path: str | os.PathLike, model) -> dict[str, GgufWeight]:
    """Module name -> quantized weight for every layer the file lets us keep quantized.
    `model`: our LlamaForCausalLM with its dense weights loaded (for the q/k row order)."""
    from gguf import GGUFReader

    config = model.config
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    parts: dict[str, dict[int, GgufWeight]] = {}
    dense_left: list[str] = []
    result: dict[str, GgufWeight] = {}
    for t in GGUFReader(str(path)).tensors:
        found = _tensor(t)
        if t.name in ("token_embd.weight", "output.weight"):
            names = ["model.embed_tokens"] if t.name == "token_embd.weight" else ["lm_head"]
            if t.name == "token_embd.weight" and model.tie_word_embeddings:
                names.append("lm_head")
            if found is None:
                dense_left.append(f"{t.name} ({t.tensor_type.name})")
            for name in names if found else ():
                result[name] = found[1]
            continue
        prefix, _, rest = t.name.partition(".")
        layer, _, kind = rest.partition(".")
        if prefix != "blk" or kind.removesuffix(".weight") not in _LAYER_TENSORS:
            continue
        module, position = _LAYER_TENSORS[kind.removesuffix(".weight")]
        name = f"model.layers.{int(layer)}.{module}"
        if found is None:
            dense_left.append(f"{t.name} ({t.tensor_type.name})")
            parts.setdefault(name, {})[position] = None
            continue
        weight = found[1]
        if kind.startswith(("attn_q", "attn_k")):
            dense = model.get_submodule(name).dense_weight()
            sizes = model._shard_sizes("qkv_proj")
            start = sum(sizes[:position])
            heads = num_heads if position == 0 else num_kv_heads
            weight = _matching_order(weight, dense[start:start + sizes[position]], heads, t.name)
        parts.setdefault(name, {})[position] = weight
    for name, pieces in parts.items():
        module = name.split(".", 3)[3]
        count = 1 + max(pos for mod, pos in _LAYER_TENSORS.values() if mod == module)
        ordered = [pieces.get(i) for i in range(count)]
        if any(p is None for p in ordered):
            continue
        if len({(p.type_name, p.in_features) for p in ordered}) > 1:
            dense_left.append(f"{name} (parts in different formats)")
            continue
        result[name] = GgufWeight.concat(ordered) if len(ordered) > 1 else ordered[0]
    if dense_left:
        logger.info("quantization gguf: %d tensors stay dense (formats without a kernel), "
                    "e.g. %s", len(dense_left), ", ".join(dense_left[:3]))
    return result


# Bump when the layout of the cached tables changes. In a subfolder: the converted
# folder's own *.safetensors are the dense checkpoint.
_CACHE_FILE = "quantized/gguf-tables-v1.safetensors"


def load_quantized(path: str | os.PathLike, model) -> dict[str, GgufWeight]:
    """read_quantized, cached beside the file's converted folder (gguf_cache): parsing the
    GGUF's metadata and reordering q/k took longer than the rest of the load."""
    from safetensors.torch import load_file, save_file

    from engine.models.gguf_cache import converted_dir_for

    cache = converted_dir_for(path) / _CACHE_FILE
    if cache.is_file():
        from safetensors import safe_open
        with safe_open(str(cache), framework="pt") as handle:
            index = json.loads(handle.metadata()["tables"])
        tensors = load_file(str(cache))
        tables = [GgufWeight(t["type"], tensors[f"{i}.qs"], tensors[f"{i}.d"],
                             tensors.get(f"{i}.offset"), t["in_features"])
                  for i, t in enumerate(index["tables"])]
        return {name: tables[i] for name, i in index["names"].items()}
    result = read_quantized(path, model)
    unique = list({id(w): w for w in result.values()}.values())
    position = {id(w): i for i, w in enumerate(unique)}
    tensors: dict[str, torch.Tensor] = {}
    for i, w in enumerate(unique):
        tensors[f"{i}.qs"], tensors[f"{i}.d"] = w.qs, w.d
        if w.offset is not None:
            tensors[f"{i}.offset"] = w.offset
    index = {"tables": [{"type": w.type_name, "in_features": w.in_features} for w in unique],
             "names": {name: position[id(w)] for name, w in result.items()}}
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    try:  # written beside and renamed: concurrent first loads never read half a file
        cache.parent.mkdir(exist_ok=True)
        save_file(tensors, str(tmp), metadata={"tables": json.dumps(index)})
        os.replace(tmp, cache)
    except OSError as exc:  # a read-only cache still serves, only slower to load
        logger.warning("quantization gguf: could not cache the tables at %s: %s", cache, exc)
        tmp.unlink(missing_ok=True)
    return result
