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
`down_proj` [E, I, H], with their biases [E, 2I] (interleaved too) and [E, H].

MXFP4 checkpoints (`quantization_config.quant_method: mxfp4`, as openai/gpt-oss ships)
store the experts as `{gate_up,down}_proj_blocks` / `_scales` (kernels/torch_mxfp4.py's
format: [E, out, in / 32, 16] and [E, out, in / 32], gate_up's outputs interleaved). They
stay MXFP4 in memory (Mxfp4FusedMoE: gpt-oss-20b's experts take 10 GB so, 38 GB widened
to bf16); loading only moves whole rows of blocks and scales into the dense stacks' order,
gate rows then up rows. The biases are read as the dense ones."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from engine.models.layers import empty_param
from engine.models.llama import ArchSpec, LlamaAttention, LlamaDecoderLayer, LlamaModel
from engine.models.moe import FusedMoE, MoEForCausalLM, Routing
from engine.models.rope import RotaryEmbedding
from kernels.dispatch import MXFP4_BLOCK as BLOCK
from kernels.dispatch import Mxfp4Stack


def quant_method(config) -> str | None:
    """The config's quantization_config.quant_method, lower-cased, or None."""
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(
        quant, "quant_method", None)
    return None if method is None else str(method).lower()


class Mxfp4FusedMoE(FusedMoE):
    """FusedMoE with its experts in MXFP4: uint8 buffers w13_blocks [E, 2I, H / 32, 16] and
    w13_scales [E, 2I, H / 32] (each expert's gate rows, then its up rows), w2_blocks
    [E, H, I / 32, 16] and w2_scales [E, H, I / 32]. `w13` / `w2` read them as
    Mxfp4Stacks dequantizing to the model dtype, which FusedMoE.forward hands to
    kernels.dispatch.fused_moe as it would the dense stacks. Buffers, not parameters: the
    loader's completeness check counts expert parts (`parts`), and `.to()` moves them."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 routing: Routing, dtype: torch.dtype, **options) -> None:
        super().__init__(hidden_size, intermediate_size, num_experts, top_k, routing, dtype,
                         **options)
        # Unregister the dense stacks (never filled): `self.w13` then finds the property.
        del self.w13, self.w2
        self.dtype = dtype
        shapes = {"w13": (2 * intermediate_size, hidden_size),
                  "w2": (hidden_size, intermediate_size)}
        for name, (rows, cols) in shapes.items():
            self.register_buffer(f"{name}_blocks", torch.empty(
                num_experts, rows, cols // BLOCK, BLOCK // 2, dtype=torch.uint8), persistent=False)
            self.register_buffer(f"{name}_scales", torch.empty(
                num_experts, rows, cols // BLOCK, dtype=torch.uint8), persistent=False)

    @property
    def w13(self) -> Mxfp4Stack:
        return Mxfp4Stack(self.w13_blocks, self.w13_scales, self.dtype)

    @property
    def w2(self) -> Mxfp4Stack:
        return Mxfp4Stack(self.w2_blocks, self.w2_scales, self.dtype)

    @property
    def parts(self) -> tuple[str, ...]:
        return super().parts + MXFP4_SCALE_PARTS


# What the scales of each part fill, beside the blocks (which count as the part itself).
MXFP4_SCALE_PARTS = ("gate_scales", "up_scales", "down_scales")


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
        block = Mxfp4FusedMoE if quant_method(config) == "mxfp4" else FusedMoE
        return block(config.hidden_size, config.intermediate_size, config.num_local_experts,
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
    # An MXFP4 checkpoint's (quant_method mxfp4): the blocks fill the parts the dense stacks
    # would, the scales their own (Mxfp4FusedMoE.parts).
    mxfp4_stacked_parts = {"gate_up_proj_blocks": ("gate", "up"),
                           "gate_up_proj_scales": ("gate_scales", "up_scales"),
                           "down_proj_blocks": ("down",), "down_proj_scales": ("down_scales",),
                           "gate_up_proj_bias": ("gate_bias", "up_bias"),
                           "down_proj_bias": ("down_bias",)}

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.mxfp4 = quant_method(config) == "mxfp4"
        if self.mxfp4:
            self.hf_stacked_parts = self.mxfp4_stacked_parts

    @classmethod
    def check_config(cls, config) -> None:
        # No hidden_act check: HF's experts run the clamped SwiGLU whatever it says.
        method = quant_method(config)
        if method not in (None, "mxfp4"):
            raise ValueError(f"model: {cls.__name__} quantization_config {method!r}: only "
                             f"bf16 / float32 weights, or MXFP4 experts")
        if method == "mxfp4":
            for what in ("hidden_size", "intermediate_size"):
                if getattr(config, what) % BLOCK:
                    raise ValueError(f"model: MXFP4 experts need {what} a multiple of {BLOCK}, "
                                     f"got {getattr(config, what)}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._refuse_other_kind(weights))

    def _refuse_other_kind(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """MXFP4 experts under a config that does not say mxfp4 (the tensors' names tell),
        or dense ones under one that does: refused by name, before anything is placed."""
        for name, tensor in weights:
            if ".mlp.experts." in name:
                part = name.rsplit(".", 1)[-1]
                if part.endswith(("_blocks", "_scales")) and not self.mxfp4:
                    raise ValueError(f"weights: {name!r}: MXFP4 experts, but the config's "
                                     f"quantization_config does not say mxfp4")
                if part in ("gate_up_proj", "down_proj") and self.mxfp4:
                    raise ValueError(f"weights: {name!r}: dense experts, but the config says "
                                     f"MXFP4")
            yield name, tensor

    def place_stacked(self, moe: FusedMoE, hf_part: str, name: str, tensor: torch.Tensor) -> None:
        experts, inter, hidden = moe.num_experts, moe.intermediate_size, self.config.hidden_size
        if hf_part.endswith(("_blocks", "_scales")):
            self._place_mxfp4(moe, hf_part, name, tensor)
            return
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

    @staticmethod
    def _place_mxfp4(moe: Mxfp4FusedMoE, hf_part: str, name: str, tensor: torch.Tensor) -> None:
        """Blocks and scales hold one row per output, already the dense stack's rows for
        down_proj ([E, H, I / 32, ...]); gate_up's rows alternate gate and up, so the even
        rows go first and the odd ones after: whole rows move, no value is touched."""
        stack = "w13" if hf_part.startswith("gate_up") else "w2"
        dest = getattr(moe, f"{stack}_{hf_part.rsplit('_', 1)[1]}")
        if tensor.dtype != torch.uint8 or tensor.shape != dest.shape:
            raise ValueError(f"weights: {name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                             f"expected torch.uint8 {tuple(dest.shape)}")
        if stack == "w13":
            inter = moe.intermediate_size
            dest[:, :inter].copy_(tensor[:, 0::2])
            dest[:, inter:].copy_(tensor[:, 1::2])
        else:
            dest.copy_(tensor)
