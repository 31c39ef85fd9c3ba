"""gpt-oss (GptOssForCausalLM): the Llama decoder with biases on q/k/v/o, a learned
attention sink per head (a logit in the head's softmax with no value:
kernels.dispatch.paged_attention's `sinks`), layers alternating sliding-window and full
attention by `layer_types` (engine/config/sliding_window.py), YaRN RoPE (rope.py), and a
mixture of experts in every layer: a biased router whose top num_experts_per_tok logits
are softmaxed (Routing.TOPK_SOFTMAX), experts with biases and the clamped SwiGLU
("swigluoai": alpha 1.702 and limit 7.0, as HF hard-codes them). lm_head is untied.

Loading takes HF's bf16 / f32 layout: the router is `mlp.router`, and the experts are
stacked already, transposed against a Linear's weight: `gate_up_proj` [E, H, 2I] with
gate and up interleaved along its last dim (gate = [..., ::2], up = [..., 1::2]) and
`down_proj` [E, I, H], with their biases [E, 2I] (interleaved too) and [E, H]. MXFP4
checkpoints (`*_blocks` / `*_scales` experts, as openai/gpt-oss ships) are refused: no
kernel here reads that format yet."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from engine.models.layers import empty_param
from engine.models.llama import ArchSpec, LlamaAttention, LlamaDecoderLayer, LlamaModel
from engine.models.moe import FusedMoE, MoEForCausalLM, Routing
from engine.models.rope import RotaryEmbedding

_MXFP4 = ("MXFP4 checkpoints (experts as *_blocks / *_scales) are not supported yet; use a "
          "bf16 or float32 export of the model")


class GptOssAttention(LlamaAttention):
    def __init__(self, config, spec: ArchSpec, rotary: RotaryEmbedding, dtype: torch.dtype,
                 sliding_window: int | None = None) -> None:
        super().__init__(config, spec, rotary, dtype, sliding_window)
        # float32 whatever the model's dtype: the attention kernels take float32 sinks, and
        # a bf16 checkpoint's values are exact in it.
        self.sinks = empty_param(self.num_heads, dtype=torch.float32)


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_class = GptOssAttention

    def build_mlp(self, config, spec: ArchSpec, dtype: torch.dtype, layer_index: int) -> nn.Module:
        return FusedMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                        config.num_experts_per_tok, Routing.TOPK_SOFTMAX, dtype,
                        router_bias=True, expert_bias=True, activation="swigluoai")


class GptOssModel(LlamaModel):
    layer_class = GptOssDecoderLayer

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        # The native whole-stack decode step knows neither sinks nor experts.
        self.fused_single_decode = False


class GptOssForCausalLM(MoEForCausalLM):
    model_class = GptOssModel
    hf_router = "router"
    hf_stacked_parts = {"gate_up_proj": ("gate", "up"),
                        "gate_up_proj_bias": ("gate_bias", "up_bias"),
                        "down_proj": ("down",), "down_proj_bias": ("down_bias",)}

    @classmethod
    def check_config(cls, config) -> None:
        # No hidden_act check: HF's experts run the clamped SwiGLU whatever it says.
        quant = getattr(config, "quantization_config", None) or {}
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(
            quant, "quant_method", None)
        if method is not None:
            what = _MXFP4 if str(method).lower() == "mxfp4" else "only bf16 / float32 weights"
            raise ValueError(f"model: {cls.__name__} quantization_config {method!r}: {what}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._refuse_mxfp4(weights))

    @staticmethod
    def _refuse_mxfp4(weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        # A config may lack its quantization_config; the tensors' names still tell.
        for name, tensor in weights:
            if name.endswith(("_blocks", "_scales")):
                raise ValueError(f"weights: {name!r}: {_MXFP4}")
            yield name, tensor

    def place_stacked(self, moe: FusedMoE, hf_part: str, name: str, tensor: torch.Tensor) -> None:
        experts, inter, hidden = moe.num_experts, moe.intermediate_size, self.config.hidden_size
        expected = {"gate_up_proj": (experts, hidden, 2 * inter),
                    "gate_up_proj_bias": (experts, 2 * inter),
                    "down_proj": (experts, inter, hidden),
                    "down_proj_bias": (experts, hidden)}[hf_part]
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {expected}")
        every = slice(None)
        if hf_part == "gate_up_proj":  # [E, H, 2I] -> gate rows [E, I, H], up rows
            moe.expert_slice(every, "gate").copy_(tensor[..., 0::2].transpose(1, 2))
            moe.expert_slice(every, "up").copy_(tensor[..., 1::2].transpose(1, 2))
        elif hf_part == "gate_up_proj_bias":
            moe.expert_slice(every, "gate_bias").copy_(tensor[..., 0::2])
            moe.expert_slice(every, "up_bias").copy_(tensor[..., 1::2])
        elif hf_part == "down_proj":  # [E, I, H] -> [E, H, I]
            moe.expert_slice(every, "down").copy_(tensor.transpose(1, 2))
        else:
            moe.expert_slice(every, "down_bias").copy_(tensor)
