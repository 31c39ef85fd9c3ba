"""Mixtral: the Llama decoder (Mistral's attention, its sliding window where the config
sets one) with a mixture of experts in place of the MLP: num_local_experts SwiGLU experts
of intermediate_size each, a bias-free router, the top num_experts_per_tok of a float32
softmax over all experts, renormalised (engine/models/moe.py). HF's per-expert w1 / w3 / w2
are gate / up / down."""
from __future__ import annotations

import torch
from torch import nn

from engine.models.llama import ArchSpec, LlamaDecoderLayer, LlamaModel
from engine.models.moe import FusedMoE, MoEForCausalLM, Routing


class MixtralDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config, spec: ArchSpec, dtype: torch.dtype, layer_index: int) -> nn.Module:
        return FusedMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                        config.num_experts_per_tok, Routing.SOFTMAX_TOPK_RENORM, dtype)


class MixtralModel(LlamaModel):
    layer_class = MixtralDecoderLayer


class MixtralForCausalLM(MoEForCausalLM):
    model_class = MixtralModel
    hf_moe_block = "block_sparse_moe"
    hf_expert_parts = {"w1": "gate", "w3": "up", "w2": "down"}
    # quantization="gguf": llama.cpp's files of it (engine/models/gguf_weights.py).
    supports_quantization = True
