"""A single sequence's decode step in one native call (kernels/cpu/decode_step.py): what
a single stream spends its time on once the matmuls are fast is the ~10 Python-level
kernel calls a layer, and this skips them. The layer-by-layer forward stays the
reference; the plan is bit-equal to it and built only where it applies."""
from __future__ import annotations

import torch
from torch import nn

from engine.models.attention import AttentionMetadata
from engine.models.layers import RMSNorm, SwiGLUMLP
from kernels import dispatch
from kernels.dispatch import DecodeStepPlan, LayerWeights


def build_plan(model: nn.Module, kv_caches: list) -> DecodeStepPlan | None:
    """model: a LlamaModel; None unless every layer is Llama's own layer, optionally with
    Qwen3's per-head q/k RMSNorms and a sliding window (the C step knows nothing else: no
    soft cap, other norm or MLP; Gemma keeps the layer-by-layer path), and float32 or bf16
    on CPU with dense or GGUF weights (GPUs and other formats keep the layer-by-layer
    path)."""
    if not all(_is_llama_layer(layer, model.rotary) for layer in model.layers):
        return None
    if type(model.norm) is not RMSNorm:
        return None
    layers = []
    for layer, (key_cache, value_cache) in zip(model.layers, kv_caches):
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(LayerWeights(
            qkv=attn.qkv_proj.kernel_weight(), o=attn.o_proj.kernel_weight(),
            gate_up=mlp.gate_up_proj.kernel_weight(), down=mlp.down_proj.kernel_weight(),
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight, key_cache=key_cache,
            value_cache=value_cache,
            q_norm=None if attn.q_norm is None else attn.q_norm.weight,
            k_norm=None if attn.k_norm is None else attn.k_norm.weight,
            window=attn.sliding_window))
    first = model.layers[0]
    attn = first.self_attn
    if not all(layer.input_layernorm.eps == layer.post_attention_layernorm.eps == model.norm.eps
               for layer in model.layers):
        return None
    # The plan holds one scale and one q/k-norm epsilon for the whole stack.
    if any(layer.self_attn.scale != attn.scale for layer in model.layers):
        return None
    qk_eps = {norm.eps for layer in model.layers
              for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm) if norm is not None}
    if len(qk_eps) > 1:
        return None
    return dispatch.decode_step_plan(layers, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                     model.rotary.rot_half, model.norm.eps, attn.scale,
                                     model.rotary.cos, model.rotary.sin, model.norm.weight,
                                     qk_eps.pop() if qk_eps else None)


def _is_llama_layer(layer: nn.Module, rotary: nn.Module) -> bool:
    # Exact types, not isinstance: a family that subclasses Llama's modules changes what
    # the layer computes; Qwen3's subclasses add only the q/k norms, which the step runs.
    from engine.models.llama import LlamaAttention, LlamaDecoderLayer
    from engine.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer

    attn = layer.self_attn
    qk_norms = (attn.q_norm, attn.k_norm)
    return (type(layer) in (LlamaDecoderLayer, Qwen3DecoderLayer)
            and type(attn) in (LlamaAttention, Qwen3Attention)
            and (all(n is None for n in qk_norms) or all(type(n) is RMSNorm for n in qk_norms))
            and attn.soft_cap is None
            and attn.rotary is rotary
            and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm
            and type(layer.mlp) is SwiGLUMLP)


def run(plan: DecodeStepPlan, embedding: torch.Tensor, positions: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor | None:
    """The hidden state, or None where the plan cannot take this step: per-layer metadata
    (the KV manager's groups of layers, each with its own block table) is one of those."""
    if not isinstance(meta, AttentionMetadata):
        return None
    tables = meta.block_tables
    if tables.dtype != torch.int32 or not tables.is_contiguous() or not embedding.is_contiguous():
        return None
    return plan.run(embedding, int(positions[0]), int(meta.slot_mapping[0]), tables,
                    int(meta.seq_lens[0]))
