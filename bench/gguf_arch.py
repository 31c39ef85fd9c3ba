"""Per-family facts for bench/gguf_from_hf.py: how llama.cpp's convert_hf_to_gguf.py lays out
Llama, Qwen3, Gemma 2, Gemma 3 (text), Phi-3, Mixtral and Qwen3-MoE checkpoints. Tensor
names come from the gguf package's TensorNameMap (llama.cpp's own table), metadata keys
from GGUFWriter's add_* methods (gguf.Keys), so only what differs per family is spelled out
here:

- which metadata each family's converter writes (llama.cpp's set_gguf_parameters);
- q/k rows permuted per head for llama.cpp's interleaved RoPE: the llama family only. Qwen3,
  Gemma and Phi-3 run NeoX-style (rotate-half) RoPE in llama.cpp, HF's own row order;
- Gemma's RMSNorms scale by (1 + w), and llama.cpp stores 1 + w (every "*norm.weight",
  Gemma 3's q/k norms included);
- the extra tensors: llama3 rope_freqs, Phi-3's longrope rope_factors_long/short;
- the mixtures of experts: Mixtral is llama.cpp's `llama` architecture with expert_count /
  expert_used_count (every layer MoE, q/k permuted as Llama's), Qwen3-MoE its `qwen3moe`
  (plus expert_feed_forward_length, the experts' width). Both route by a softmax over all
  experts whose top-k weights llama.cpp always renormalises, and make every layer MoE.

What llama.cpp derives instead of reading (Gemma's attention scale, its sliding-window
pattern, Gemma 3's sliding-layer rope base) has no key: a config that disagrees with the
derivation is refused rather than written into a file llama.cpp would misread.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from gguf import (MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, GGUFWriter,
                  RopeScalingType)


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def kv_heads(config: dict) -> int:
    return config.get("num_key_value_heads") or config["num_attention_heads"]


# llama.cpp scales Gemma's attention by 1/sqrt(head_dim) except at the 27B sizes, which it
# recognises by layer count and scales by 1/sqrt(hidden / heads) (llama-model.cpp,
# f_attention_scale): HF's query_pre_attn_scalar is not in the file.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Every n-th layer attends globally, the others through the window (llama.cpp's
# set_swa_pattern: fixed per architecture, not read from the file).
GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA3_SWA_ROPE_BASE = 10000.0  # llama.cpp's fixed rope base for Gemma 3's sliding layers


def gemma_query_scale_dim(arch: str, layers: int, hidden: int, heads: int, dim: int) -> int:
    """The query_pre_attn_scalar llama.cpp's Gemma attention implies."""
    return hidden // heads if layers == GEMMA_27B_LAYERS[arch] else dim


def gemma_layer_types(arch: str, layers: int) -> list[str]:
    n = GEMMA_SWA_PATTERN[arch]
    return ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(layers)]


def llama3_rope_factors(config: dict) -> np.ndarray:
    """What llama.cpp divides each base frequency by for HF's llama3 rope_scaling."""
    s, dim = config["rope_scaling"], head_dim(config)
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


def _rope_type(config: dict) -> str | None:
    s = config.get("rope_scaling") or {}
    return s.get("rope_type", s.get("type")) if s else None


def _common(w: GGUFWriter, c: dict) -> None:
    """What llama.cpp's TextModel base writes for every family."""
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(kv_heads(c))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])


def _base_rope(w: GGUFWriter, c: dict, allowed: tuple[str, ...]) -> None:
    """The TextModel base's rope keys: the base and HF's linear / yarn scaling."""
    w.add_rope_freq_base(c.get("rope_theta", 10000.0))
    kind = _rope_type(c)
    if kind is None or kind == "default":
        return
    if kind not in allowed:
        raise ValueError(f"rope_scaling {c['rope_scaling']} has no GGUF form here for "
                         f"{c['model_type']} ({', '.join(allowed) or 'none'} only)")
    s = c["rope_scaling"]
    w.add_rope_scaling_type(RopeScalingType.LINEAR if kind == "linear" else RopeScalingType.YARN)
    w.add_rope_scaling_factor(s["factor"])
    if kind == "yarn":
        w.add_rope_scaling_orig_ctx_len(s["original_max_position_embeddings"])


def _llama(w: GGUFWriter, c: dict) -> None:
    _common(w, c)
    w.add_key_length(head_dim(c))
    w.add_value_length(head_dim(c))
    w.add_rope_dimension_count(head_dim(c))
    w.add_rope_freq_base(c.get("rope_theta", 10000.0))
    w.add_vocab_size(c["vocab_size"])
    if _rope_type(c) not in (None, "default", "llama3"):
        raise ValueError(f"rope_scaling {c['rope_scaling']} has no GGUF form here (llama3 only)")


def _qwen3(w: GGUFWriter, c: dict) -> None:
    _common(w, c)
    w.add_key_length(head_dim(c))
    w.add_value_length(head_dim(c))
    _base_rope(w, c, ("yarn",))
    if c.get("use_sliding_window"):
        raise ValueError("qwen3: use_sliding_window has no GGUF form (llama.cpp attends fully)")


def _experts(w: GGUFWriter, c: dict, count_key: str) -> None:
    """TextModel's expert keys (llama.cpp's converter writes them for every family)."""
    w.add_expert_count(c[count_key])
    w.add_expert_used_count(c["num_experts_per_tok"])


def _mixtral(w: GGUFWriter, c: dict) -> None:
    if _rope_type(c) not in (None, "default"):
        raise ValueError(f"mixtral: rope_scaling {c['rope_scaling']} has no GGUF form here")
    if c.get("sliding_window") is not None:
        raise ValueError("mixtral: sliding_window has no GGUF form (llama.cpp's llama "
                         "architecture attends fully)")
    _llama(w, c)
    _experts(w, c, "num_local_experts")


def _qwen3_moe(w: GGUFWriter, c: dict) -> None:
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"qwen3_moe: mlp_only_layers {c.get('mlp_only_layers')} / "
                         f"decoder_sparse_step {c.get('decoder_sparse_step')} have no GGUF form "
                         "(llama.cpp's qwen3moe makes every layer MoE)")
    if not c.get("norm_topk_prob"):
        raise ValueError("qwen3_moe: norm_topk_prob false has no GGUF form (llama.cpp's "
                         "qwen3moe renormalises the top-k routing weights)")
    _qwen3(w, c)
    _experts(w, c, "num_experts")
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])


def _check_gemma(arch: str, c: dict) -> None:
    layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    scale = gemma_query_scale_dim(arch, layers, hidden, heads, head_dim(c))
    if (c.get("query_pre_attn_scalar") or scale) != scale:
        raise ValueError(f"{arch}: query_pre_attn_scalar {c['query_pre_attn_scalar']} has no GGUF "
                         f"form: llama.cpp scales this model's attention by 1/sqrt({scale})")
    types = c.get("layer_types")
    if types is not None and list(types) != gemma_layer_types(arch, layers):
        raise ValueError(f"{arch}: layer_types {types} has no GGUF form: llama.cpp makes every "
                         f"{GEMMA_SWA_PATTERN[arch]}th layer global, the others sliding")
    if (c.get("sliding_window_pattern") or GEMMA_SWA_PATTERN[arch]) != GEMMA_SWA_PATTERN[arch]:
        raise ValueError(f"{arch}: sliding_window_pattern {c['sliding_window_pattern']} has no "
                         f"GGUF form (llama.cpp: {GEMMA_SWA_PATTERN[arch]})")
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{arch}: hidden_activation {act!r} has no GGUF form "
                         "(llama.cpp: tanh-approximated GELU)")


def _gemma2(w: GGUFWriter, c: dict) -> None:
    _check_gemma("gemma2", c)
    if not c.get("tie_word_embeddings", True):
        raise ValueError("gemma2: an untied lm_head has no GGUF form (llama.cpp reads "
                         "token_embd as the output)")
    _common(w, c)
    w.add_key_length(head_dim(c))
    w.add_value_length(head_dim(c))
    # llama.cpp's Gemma2 converter writes no rope base (its default is Gemma 2's 10000);
    # every llama.cpp architecture reads the key, so the file states the config's own.
    w.add_rope_freq_base(c.get("rope_theta", 10000.0))
    w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])


def _gemma3(w: GGUFWriter, c: dict) -> None:
    _check_gemma("gemma3", c)
    if (c.get("rope_local_base_freq") or GEMMA3_SWA_ROPE_BASE) != GEMMA3_SWA_ROPE_BASE:
        raise ValueError(f"gemma3: rope_local_base_freq {c['rope_local_base_freq']} has no GGUF "
                         f"form (llama.cpp: {GEMMA3_SWA_ROPE_BASE:g} on the sliding layers)")
    if c.get("attn_logit_softcapping") is not None:
        raise ValueError("gemma3: attn_logit_softcapping has no GGUF form (Gemma 3 has none)")
    _common(w, c)
    w.add_key_length(head_dim(c))
    w.add_value_length(head_dim(c))
    _base_rope(w, c, ("linear",))  # Gemma 3 4B+ scale their global layers' positions by 8
    if c.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])


def _phi3_rope_dims(c: dict) -> int:
    rotary = int((c.get("partial_rotary_factor") or 1.0) * c["hidden_size"])
    return rotary // c["num_attention_heads"]


def _phi3_scale(c: dict) -> float:
    return c["max_position_embeddings"] / c["original_max_position_embeddings"]


def _phi3(w: GGUFWriter, c: dict) -> None:
    _common(w, c)
    w.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
    w.add_rope_dimension_count(_phi3_rope_dims(c))
    w.add_rope_freq_base(c.get("rope_theta", 10000.0))
    # 0 says "no window" (Phi-4's configs have none; Phi-3-mini's 2047).
    w.add_sliding_window(c.get("sliding_window") or 0)
    kind = _rope_type(c)
    if kind in ("longrope", "su"):
        scale = _phi3_scale(c)
        orig = c["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig))
                                        if scale > 1.0 else 1.0)
    elif kind not in (None, "default"):
        raise ValueError(f"phi3: rope_scaling {c['rope_scaling']} has no GGUF form here "
                         "(longrope only)")


def _llama_extra(c: dict) -> list[tuple[str, np.ndarray]]:
    if _rope_type(c) != "llama3":
        return []
    return [(TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_factors(c))]


def _phi3_extra(c: dict) -> list[tuple[str, np.ndarray]]:
    s = c.get("rope_scaling") or {}
    if not s.get("long_factor"):
        return []
    long, short = (np.array(s[k], dtype=np.float32) for k in ("long_factor", "short_factor"))
    if not len(long) == len(short) == _phi3_rope_dims(c) // 2:
        raise ValueError(f"phi3: long/short rope factors need {_phi3_rope_dims(c) // 2} "
                         f"values each, got {len(long)} and {len(short)}")
    return [(TENSOR_NAMES[MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight", long),
            (TENSOR_NAMES[MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight", short)]


@dataclass(frozen=True)
class Family:
    arch: MODEL_ARCH
    metadata: Callable[[GGUFWriter, dict], None]
    permute_qk: bool = False    # llama.cpp's interleaved-RoPE row order for q and k
    norm_shift: float = 0.0     # added to every "*norm.weight" (Gemma's 1 + w)
    drop_lm_head: bool = False  # llama.cpp's converter skips it (Gemma 2: always tied)
    extra: Callable[[dict], list[tuple[str, np.ndarray]]] = field(default=lambda c: [])


# HF model_type -> how llama.cpp converts it.
FAMILIES = {
    "llama": Family(MODEL_ARCH.LLAMA, _llama, permute_qk=True, extra=_llama_extra),
    "qwen3": Family(MODEL_ARCH.QWEN3, _qwen3),
    "gemma2": Family(MODEL_ARCH.GEMMA2, _gemma2, norm_shift=1.0, drop_lm_head=True),
    "gemma3_text": Family(MODEL_ARCH.GEMMA3, _gemma3, norm_shift=1.0),
    "phi3": Family(MODEL_ARCH.PHI3, _phi3, extra=_phi3_extra),
    "mixtral": Family(MODEL_ARCH.LLAMA, _mixtral, permute_qk=True),
    "qwen3_moe": Family(MODEL_ARCH.QWEN3MOE, _qwen3_moe),
}


def family_for(config: dict) -> Family:
    """The config's family; ValueError where it, or a setting of this config, has no GGUF
    form (the metadata is written to a file-less writer, which refuses what write_gguf
    would): callers refuse before they write anything."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r}: GGUF conversion here covers "
                         f"{sorted(FAMILIES)}")
    family = FAMILIES[model_type]
    family.metadata(GGUFWriter(None, MODEL_ARCH_NAMES[family.arch]), config)
    return family
