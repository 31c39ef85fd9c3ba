"""Gemma 2 and Gemma 3 (text: Gemma3ForCausalLM) over the paged KV cache.

Against Llama: (1 + w) RMSNorms in float32 (layers.GemmaRMSNorm), a norm before and after
both attention and MLP, GeGLU with tanh GELU, embeddings times sqrt(hidden) rounded to
the model dtype, attention scaled by query_pre_attn_scalar ** -0.5, tied embeddings,
and the sliding-window layers of engine/config/sliding_window.py. Gemma 2 soft-caps the
attention logits and the final logits; Gemma 3 norms q and k per head instead (HF's
Gemma 3 reads attn_logit_softcapping but never applies it, so neither does this), caps
the final logits only if its config asks, and rotates its sliding layers with a RoPE of
their own: base rope_local_base_freq, no scaling (rope_scaling is the global layers').

The projections keep Llama's module names (qkv_proj, o_proj, gate_up_proj, down_proj)
and layout, so LoRA, tensor parallelism and the loader apply unchanged. A single sequence's
decode runs the whole stack in one native call where it applies (single_decode.py), as
Llama's does; the embedding's scaling and the final logit cap stay out here."""
from __future__ import annotations

import copy

import torch
from torch import nn

from engine.config.sliding_window import layer_windows
from engine.models import single_decode
from engine.models.attention import AttentionMetadata, per_layer
from engine.models.layers import Embedding, GeGLUMLP, GemmaRMSNorm
from engine.models.llama import (ArchSpec, CosSin, KVCache, LlamaAttention, LlamaForCausalLM,
                                 LlamaModel, model_windows)
from engine.models.rope import RotaryEmbedding
from kernels import dispatch
from kernels.dispatch import GgufWeight

_ACTIVATION = "gelu_pytorch_tanh"


class GemmaAttention(LlamaAttention):
    def __init__(self, config, rotary: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window: int | None, soft_cap: float | None, qk_norm: bool) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, ArchSpec(qkv_bias=bias, o_bias=bias, mlp_bias=False), rotary,
                         dtype, sliding_window)
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.soft_cap = soft_cap
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, attention: GemmaAttention, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = attention
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = GeGLUMLP(hidden, config.intermediate_size, False, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, cos_sin: CosSin, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: returns (this layer's MLP output, the residual stream
        before it), and the next norm adds the two. The post-norms apply to a branch's
        output before it joins the stream."""
        x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(cos_sin, x, kv_cache, meta)
        x, _ = self.post_attention_layernorm.forward(x)
        x, residual = self.pre_feedforward_layernorm.forward(x, residual)
        x = self.mlp.forward(x)
        x, _ = self.post_feedforward_layernorm.forward(x)
        return x, residual


def sliding_kind(config) -> list[bool]:
    """Which layers are of the sliding kind, also when the window is disabled (the loader
    then clears config.sliding_window, and every layer attends in full): Gemma 3 picks a
    layer's RoPE by its kind, as HF does, not by whether it has a window."""
    probe = copy.copy(config)
    probe.sliding_window = getattr(config, "sliding_window", None) or 1
    return [w is not None for w in layer_windows(probe)]


def _local_rope_config(config):
    # HF builds Gemma 3's local RoPE from a copy of the config the same way.
    local = copy.copy(config)
    local.rope_theta = config.rope_local_base_freq
    local.rope_scaling = None
    return local


class GemmaModel(nn.Module):
    # Per generation: soft-capped attention logits (Gemma 2), per-head q/k norms and a
    # local RoPE for the sliding layers (Gemma 3).
    attn_soft_cap_key: str | None = None
    qk_norm = False
    local_rope = False

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.embed_quantized: GgufWeight | None = None
        # HF multiplies by sqrt(hidden) held in the model dtype (bf16 rounds 55.43 to 55.5).
        self.register_buffer("normalizer", torch.tensor(config.hidden_size ** 0.5, dtype=dtype),
                             persistent=False)
        self.rotary = RotaryEmbedding(config, dtype)
        self.rotary_local = (RotaryEmbedding(_local_rope_config(config), dtype)
                             if self.local_rope else None)
        soft_cap = getattr(config, self.attn_soft_cap_key, None) if self.attn_soft_cap_key else None
        layers, self.layer_rotary = [], []
        for window, sliding in zip(model_windows(config), sliding_kind(config)):
            local = self.local_rope and sliding
            rotary = self.rotary_local if local else self.rotary
            self.layer_rotary.append(int(local))
            attention = GemmaAttention(config, rotary, dtype, window, soft_cap, self.qk_norm)
            layers.append(GemmaDecoderLayer(config, attention, dtype))
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # As LlamaModel's: False keeps the layer-by-layer path (LoRA's runtime saves and
        # restores it on every decoder).
        self.fused_single_decode = True
        self._single_plan: tuple[int, object] | None = None  # (KV cache address, plan or None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata | list[AttentionMetadata]) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches: expected {len(self.layers)} layers, got {len(kv_caches)}")
        metas = per_layer(meta, len(self.layers))
        x = self.embed(input_ids) * self.normalizer
        if self.fused_single_decode and single_decode.applies(metas[0], input_ids.shape[0]):
            plan = self._plan_for(kv_caches)
            if plan is not None:
                hidden = single_decode.run(plan, x, positions, meta)
                if hidden is not None:
                    return hidden
        # Each table gathered once per forward, for all the layers that use it.
        tables = [self.rotary.lookup(positions)]
        if self.rotary_local is not None:
            tables.append(self.rotary_local.lookup(positions))
        residual = None
        for layer, kv_cache, layer_meta, which in zip(self.layers, kv_caches, metas,
                                                      self.layer_rotary):
            x, residual = layer.forward(tables[which], x, residual, kv_cache, layer_meta)
        x, _ = self.norm.forward(x, residual)
        return x

    _plan_for = LlamaModel._plan_for  # the plan, built once per KV cache

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_quantized is not None:
            return dispatch.gguf_embedding(input_ids, self.embed_quantized, self.norm.weight.dtype)
        return self.embed_tokens.forward(input_ids)


class Gemma2Model(GemmaModel):
    attn_soft_cap_key = "attn_logit_softcapping"


class Gemma3Model(GemmaModel):
    qk_norm = True
    local_rope = True


class _GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def check_config(cls, config) -> None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act != _ACTIVATION:
            raise ValueError(f"model: hidden_activation {act!r} unsupported for {cls.__name__} "
                             f"(only {_ACTIVATION})")


class Gemma2ForCausalLM(_GemmaForCausalLM):
    model_class = Gemma2Model


class Gemma3ForCausalLM(_GemmaForCausalLM):
    model_class = Gemma3Model

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"model: use_bidirectional_attention unsupported for "
                             f"{cls.__name__} (a causal decoder only)")
