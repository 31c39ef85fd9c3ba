"""The quantized tensors of a GGUF file, named and shaped for our Llama-family models
(Llama, Qwen2/3, Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE; quantization="gguf"): the weights
stay in the file's blocks, see kernels/cpu/gguf_weight.py. Only the matrices of our fused
linear layers, the experts and the embedding / output tables are taken; the small tensors
(norms, Qwen3's and Gemma 3's q/k norms, Gemma's post-norms, rope factors, MoE routers) stay
with the dense weights of the converted folder, read from the same file (Gemma's 1 + w
undone there).

GGUF stores Llama's q and k projections with the rows of each head interleaved (llama.cpp's
converter permutes them for its RoPE; Qwen3, Gemma and Phi-3 keep HF's order); which order a
file uses is read off the data: the dequantized rows are compared with the dense weights
loaded from the same file, both orders tried. Phi-3's checkpoint comes fused and llama.cpp
keeps it so: attn_qkv holds q, k, v rows and ffn_up gate then up rows, our own layouts.
Tensors in formats the kernel lacks (F32, F16, K-quants) leave their layer dense, and so
does a fused layer whose parts differ in format.

Mixtures of experts (Mixtral, Qwen3-MoE): llama.cpp stacks each layer's experts into one
tensor per projection, [experts, out, in] (ffn_gate_exps, ffn_up_exps, ffn_down_exps). Each
expert's rows are cut from the memory-mapped file one expert at a time and kept as its own
tables, gate and up rows stacked into one [2I, H] table as our w13 (blocks run along a row,
so rows of one format concatenate), down as w2: named "{block}.w13.{e}" / "{block}.w2.{e}"
for MoEForCausalLM.quantize. Only quantized bytes are read; nothing of them is widened to
float32 here. A layer keeps its experts dense where any of the three is in a format the
kernel lacks, or gate and up differ; the router (ffn_gate_inp, F32 in llama.cpp's files)
stays dense.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import torch

from kernels.dispatch import GGUF_FORMATS, GgufWeight

logger = logging.getLogger(__name__)

# Our fused module -> the GGUF per-layer tensors that make it, in row order, one tuple per
# layout a file may use: split parts (llama.cpp's usual) or the checkpoint's own fusion
# (Phi-3's attn_qkv; its ffn_up holds gate then up, what llama.cpp's SwiGLU splits in two).
_MODULES = {"self_attn.qkv_proj": (("attn_q", "attn_k", "attn_v"), ("attn_qkv",)),
            "self_attn.o_proj": (("attn_output",),),
            "mlp.gate_up_proj": (("ffn_gate", "ffn_up"), ("ffn_up",)),
            "mlp.down_proj": (("ffn_down",),)}
_KINDS = {kind for layouts in _MODULES.values() for layout in layouts for kind in layout}
# A layer's stacked experts: gate and up make w13, down w2.
_EXPERT_KINDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _head_rows_order(num_heads: int, rows: int) -> torch.Tensor:
    """Index taking a permuted file's rows back to HF's order: within each head the file
    holds rows (i, half) at 2 i + half, HF at half * head_dim / 2 + i."""
    head_dim = rows // num_heads
    h = torch.arange(num_heads).view(-1, 1, 1) * head_dim
    half = torch.arange(2).view(1, -1, 1)
    i = torch.arange(head_dim // 2).view(1, 1, -1)
    return (h + 2 * i + half).reshape(-1)


def _section_order(weight: GgufWeight, dense: torch.Tensor, start: int, num_heads: int,
                   name: str) -> torch.Tensor | None:
    """Rows start .. start + len(dense) of `weight` (q's or k's heads) in HF's row order:
    None where the file already has it, else the index into `weight` that restores it
    (decided on the first head's rows: dequantizing whole tables twice per layer would
    double the load time)."""
    rows = dense.shape[0]
    head_dim = rows // num_heads
    dense = dense[:head_dim]
    # The dense copy was rounded to the model's dtype: round ours the same way, and allow
    # one unit in its last place where float32 rounding put a value on the other side of
    # a tie (bf16 alone is 2^-9 relative, past a fixed 1e-3 of the largest weight where
    # many weights sit near it, as in a Q4_0 file of random weights). The wrong order
    # misses by about the weights themselves.
    dtype = dense.dtype
    dense = dense.float()
    tolerance = 1e-3 * float(dense.abs().max()) + 1e-6 + torch.finfo(dtype).eps * dense.abs()
    permuted = start + _head_rows_order(num_heads, rows)
    for order in (None, permuted):
        pick = torch.arange(start, start + head_dim) if order is None else order[:head_dim]
        first_head = weight.dequantize(pick).to(dtype).float()
        if bool(((first_head - dense).abs() <= tolerance).all()):
            return order
    raise ValueError(f"quantization: {name} in the GGUF file matches neither row order of "
                     "the dense weights loaded from it")


def _matching_order(weight: GgufWeight, dense: torch.Tensor, num_heads: int,
                    name: str) -> GgufWeight:
    """The weight (one projection's rows) in HF's row order, whichever order the file used."""
    order = _section_order(weight, dense, 0, num_heads, name)
    return weight if order is None else weight.select_rows(order)


def _qkv_in_hf_order(weight: GgufWeight, dense: torch.Tensor, sizes: tuple[int, ...],
                     heads: tuple[int, int], name: str) -> GgufWeight:
    """The fused q/k/v table with q's and k's rows each in HF's order."""
    pieces, start = [], 0
    for size, count in zip(sizes, (*heads, 0)):
        order = (_section_order(weight, dense[start:start + size], start, count, f"{name} rows "
                                f"{start}..{start + size}") if count else None)
        pieces.append(torch.arange(start, start + size) if order is None else order)
        start += size
    index = torch.cat(pieces)
    return weight if torch.equal(index, torch.arange(start)) else weight.select_rows(index)


def _tensor(reader_tensor) -> tuple[str, GgufWeight] | None:
    type_name = reader_tensor.tensor_type.name
    if type_name not in GGUF_FORMATS:
        return None
    blocks = torch.from_numpy(np.array(reader_tensor.data, copy=True)).view(torch.uint8)
    in_features = int(reader_tensor.shape[0])  # GGUF lists dimensions innermost first
    return type_name, GgufWeight.from_blocks(type_name, blocks.reshape(blocks.shape[0], -1),
                                             in_features)


def _expert_rows(reader_tensor, expert: int) -> GgufWeight:
    """One expert's [out, in] table of a stacked [experts, out, in] tensor (the file's bytes
    for it alone are copied)."""
    blocks = torch.from_numpy(np.array(reader_tensor.data[expert], copy=True)).view(torch.uint8)
    return GgufWeight.from_blocks(reader_tensor.tensor_type.name,
                                  blocks.reshape(blocks.shape[0], -1),
                                  int(reader_tensor.shape[0]))


def _expert_tables(stacks: dict, name: str, moe, dense_left: list[str]) -> dict[str, GgufWeight]:
    """`name`.w13.{e} / .w2.{e} -> each expert's tables, or none (dense_left says why)."""
    if set(stacks) != set(_EXPERT_KINDS):
        raise ValueError(f"quantization: {name}'s experts need {', '.join(_EXPERT_KINDS)} in "
                         f"the GGUF file, found {sorted(stacks)}")
    gate, up, down = (stacks[k] for k in _EXPERT_KINDS)
    types = [t.tensor_type.name for t in (gate, up, down)]
    if not set(types) <= set(GGUF_FORMATS) or types[0] != types[1]:
        dense_left.append(f"{name} experts ({'/'.join(types)})")
        return {}
    experts = int(gate.data.shape[0])
    if moe is None or experts != moe.num_experts:
        raise ValueError(f"quantization: the GGUF file has {experts} experts in {name}, the "
                         f"model {getattr(moe, 'num_experts', 'no MoE block')}")
    tables = {}
    for e in range(experts):
        tables[f"{name}.w13.{e}"] = GgufWeight.concat([_expert_rows(gate, e), _expert_rows(up, e)])
        tables[f"{name}.w2.{e}"] = _expert_rows(down, e)
    return tables


def read_quantized(path: str | os.PathLike, model) -> dict[str, GgufWeight]:
    """Module name -> quantized weight for every layer the file lets us keep quantized.
    `model`: our LlamaForCausalLM (or a subclass) with its dense weights loaded (for the
    q/k row order and the fused layers' sizes)."""
    from gguf import GGUFReader

    config = model.config
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    layers: dict[int, dict[str, tuple[str, GgufWeight | None]]] = {}
    dense_left: list[str] = []
    result: dict[str, GgufWeight] = {}
    experts: dict[int, dict[str, object]] = {}  # layer -> kind -> the file's stacked tensor
    for t in GGUFReader(str(path)).tensors:
        if t.name.startswith("blk.") and t.name.split(".")[2] in _EXPERT_KINDS:
            experts.setdefault(int(t.name.split(".")[1]), {})[t.name.split(".")[2]] = t
            continue  # read an expert at a time below, not whole
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
        kind = kind.removesuffix(".weight")
        if prefix != "blk" or kind not in _KINDS:
            continue  # norms, biases, rope factors: the dense path's
        if found is None:
            dense_left.append(f"{t.name} ({t.tensor_type.name})")
        layers.setdefault(int(layer), {})[kind] = (t.name, None if found is None else found[1])
    for layer, tensors in sorted(layers.items()):
        for module, layouts in _MODULES.items():
            # The first layout whose parts the file has: split gate and up before a lone
            # ffn_up, which then holds both.
            layout = next((kinds for kinds in layouts if all(k in tensors for k in kinds)), None)
            if layout is None:
                continue
            name = f"model.layers.{layer}.{module}"
            parts = [tensors[k][1] for k in layout]
            if any(p is None for p in parts):
                continue
            if len({(p.type_name, p.in_features) for p in parts}) > 1:
                dense_left.append(f"{name} (parts in different formats)")
                continue
            weight = GgufWeight.concat(parts) if len(parts) > 1 else parts[0]
            dense = model.get_submodule(name).dense_weight()
            if (weight.out_features, weight.in_features) != tuple(dense.shape):
                raise ValueError(f"quantization: {' + '.join(tensors[k][0] for k in layout)} "
                                 f"in the GGUF file is {weight.out_features}x"
                                 f"{weight.in_features}, {name} {tuple(dense.shape)}")
            if module == "self_attn.qkv_proj":
                weight = _qkv_in_hf_order(weight, dense, model._shard_sizes("qkv_proj"),
                                          (num_heads, num_kv_heads), name)
            result[name] = weight
    for layer, stacks in sorted(experts.items()):  # one layer's experts at a time
        name = f"model.layers.{layer}.mlp"
        moe = model.get_submodule(name)
        result.update(_expert_tables(stacks, name, moe if hasattr(moe, "num_experts") else None,
                                     dense_left))
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
