"""Qwen3-MoE: Qwen3's decoder (q/k norms, engine/models/qwen3.py) where a layer's MLP is a
mixture of experts when it is not in mlp_only_layers and (index + 1) is a multiple of
decoder_sparse_step (HF's rule), else the dense SwiGLU MLP of intermediate_size. Experts
are moe_intermediate_size wide; the bias-free router takes the top num_experts_per_tok of
a float32 softmax over all experts, renormalised only under norm_topk_prob
(engine/models/moe.py)."""
from __future__ import annotations

import torch
from torch import nn

from engine.models.llama import ArchSpec
from engine.models.moe import FusedMoE, MoEForCausalLM, Routing
from engine.models.qwen3 import Qwen3DecoderLayer, Qwen3Model


def is_moe_layer(config, layer_index: int) -> bool:
    return (layer_index not in (config.mlp_only_layers or ()) and config.num_experts > 0
            and (layer_index + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def build_mlp(self, config, spec: ArchSpec, dtype: torch.dtype, layer_index: int) -> nn.Module:
        if not is_moe_layer(config, layer_index):
            return super().build_mlp(config, spec, dtype, layer_index)
        routing = Routing.SOFTMAX_TOPK_RENORM if config.norm_topk_prob else Routing.SOFTMAX_TOPK
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                        config.num_experts_per_tok, routing, dtype)


class Qwen3MoeModel(Qwen3Model):
    layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MoEForCausalLM):
    model_class = Qwen3MoeModel
    hf_expert_parts = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    # quantization="gguf": llama.cpp's files of it (engine/models/gguf_weights.py).
    supports_quantization = True
