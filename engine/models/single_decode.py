"""A single sequence's decode step in one native call (kernels/cpu/decode_step.py): what
a single stream spends its time on once the matmuls are fast is the ~10 Python-level
kernel calls a layer, and this skips them. The layer-by-layer forward stays the
reference; the plan is bit-equal to it and built only where it applies."""
from __future__ import annotations

import torch
from torch import nn

from engine.models.attention import AttentionMetadata
from engine.models.layers import GeGLUMLP, GemmaRMSNorm, RMSNorm, SwiGLUMLP
from kernels import dispatch
from kernels.dispatch import DecodeStepPlan, LayerWeights


def build_plan(model: nn.Module, kv_caches: list) -> DecodeStepPlan | None:
    """model: a LlamaModel or a GemmaModel; None unless every layer is Llama's own layer
    (optionally with Qwen3's per-head q/k RMSNorms and a sliding window) or every layer is
    Gemma's (Gemma 2's soft cap, Gemma 3's q/k norms and local RoPE), and float32 or bf16
    on CPU with dense or GGUF weights (GPUs and other formats keep the layer-by-layer
    path)."""
    gemma = all(_is_gemma_layer(layer, model) for layer in model.layers)
    if gemma:
        if type(model.norm) is not GemmaRMSNorm:
            return None
    elif (not all(_is_llama_layer(layer, model.rotary) for layer in model.layers)
          or type(model.norm) is not RMSNorm):
        return None
    layers = []
    for layer, (key_cache, value_cache) in zip(model.layers, kv_caches):
        attn, mlp = layer.self_attn, layer.mlp
        own_rope = attn.rotary is not model.rotary  # Gemma 3's local layers
        if own_rope and attn.rotary.rot_half != model.rotary.rot_half:
            return None
        layers.append(LayerWeights(
            qkv=attn.qkv_proj.kernel_weight(), o=attn.o_proj.kernel_weight(),
            gate_up=mlp.gate_up_proj.kernel_weight(), down=mlp.down_proj.kernel_weight(),
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight, key_cache=key_cache,
            value_cache=value_cache,
            q_norm=None if attn.q_norm is None else attn.q_norm.weight,
            k_norm=None if attn.k_norm is None else attn.k_norm.weight,
            window=attn.sliding_window, soft_cap=attn.soft_cap,
            cos_table=attn.rotary.cos if own_rope else None,
            sin_table=attn.rotary.sin if own_rope else None,
            pre_ff_norm=layer.pre_feedforward_layernorm.weight if gemma else None,
            post_ff_norm=layer.post_feedforward_layernorm.weight if gemma else None))
    attn = model.layers[0].self_attn
    # The plan holds one epsilon for the stack's norms, one for the q/k norms, one scale.
    norms = [model.norm]
    for layer in model.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        if gemma:
            norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    if any(norm.eps != model.norm.eps for norm in norms):
        return None
    if any(layer.self_attn.scale != attn.scale for layer in model.layers):
        return None
    qk_eps = {norm.eps for layer in model.layers
              for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm) if norm is not None}
    if len(qk_eps) > 1:
        return None
    return dispatch.decode_step_plan(layers, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                     model.rotary.rot_half, model.norm.eps, attn.scale,
                                     model.rotary.cos, model.rotary.sin, model.norm.weight,
                                     qk_eps.pop() if qk_eps else None, gemma)


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


def _is_gemma_layer(layer: nn.Module, model: nn.Module) -> bool:
    from engine.models.gemma import GemmaAttention, GemmaDecoderLayer

    if type(layer) is not GemmaDecoderLayer:
        return False
    attn = layer.self_attn
    qk_norms = (attn.q_norm, attn.k_norm)
    norms = (layer.input_layernorm, layer.post_attention_layernorm,
             layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
    return (type(attn) is GemmaAttention
            and (all(n is None for n in qk_norms)
                 or all(type(n) is GemmaRMSNorm for n in qk_norms))
            and (attn.rotary is model.rotary or attn.rotary is model.rotary_local)
            and all(type(n) is GemmaRMSNorm for n in norms)
            and type(layer.mlp) is GeGLUMLP)


def applies(meta: AttentionMetadata, rows: int) -> bool:
    """Whether a step of `rows` tokens may take the fused step (the plan may still refuse
    it): one sequence, all its rows this step's queries, and past one row a context before
    them (a speculative verification: its last token and drafts). A fresh prompt keeps the
    layer path, whose prefill kernels it was bit-equal to before drafts came, and which
    serve long prompts better."""
    if meta.max_query_len != rows or meta.seq_lens.shape[0] != 1:
        return False
    # (Off a GPU only past one row: reading seq_lens there would wait for the device.)
    return rows == 1 or (not meta.seq_lens.is_cuda and int(meta.seq_lens[0]) > rows)


def run(plan: DecodeStepPlan, embedding: torch.Tensor, positions: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor | None:
    """The hidden states, or None where the plan cannot take this step: one sequence's
    rows (its last token, and its drafts when it speculates: query_start_loc [0, T]), at
    most the plan's max_rows. Per-layer metadata (the KV manager's groups of layers, each
    with its own block table and slots: the model runner hands every layer of a group the
    same object) goes in as one block table and slot per group and each layer's group
    index."""
    if isinstance(meta, AttentionMetadata):
        groups, layer_groups = [meta], None
    else:
        index: dict[int, int] = {}
        layer_groups = tuple(index.setdefault(id(m), len(index)) for m in meta)
        groups = list({id(m): m for m in meta}.values())  # in first-seen order, as index
    rows = embedding.shape[0]
    for group in groups:
        tables = group.block_tables
        if (tables.dtype != torch.int32 or not tables.is_contiguous()
                or group.max_query_len != rows):
            return None
    if not embedding.is_contiguous():
        return None
    return plan.run(embedding, positions, [g.slot_mapping for g in groups],
                    [g.block_tables for g in groups], int(groups[0].seq_lens[0]), layer_groups)
