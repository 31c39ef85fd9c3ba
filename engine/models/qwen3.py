"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before RoPE (q_norm,
k_norm: one weight of head_dim each), head_dim from the config, no q/k/v bias unless
attention_bias says so. Everything else, loading included, is llama.py's."""
from __future__ import annotations

import torch

from engine.models.layers import RMSNorm
from engine.models.llama import (ArchSpec, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                 LlamaModel)
from engine.models.rope import RotaryEmbedding


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, spec: ArchSpec, rotary: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window: int | None = None) -> None:
        super().__init__(config, spec, rotary, dtype, sliding_window)
        # HF's Qwen3RMSNorm is Llama's (rounds to the dtype, then the weight multiply).
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model
