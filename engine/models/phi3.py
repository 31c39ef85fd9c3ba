"""Phi-3 (and Phi-3.5 / Phi-4-mini, which share its class): the Llama decoder, with the
checkpoint's q/k/v and gate/up already fused as qkv_proj ([q | k | v] rows) and
gate_up_proj ([gate | up] rows, up * silu(gate)), our own layout, so they load as they
are. Partial rotary and longrope scaling are engine/models/rope.py's; which LongRoPE
factors a position gets: docs/models.md, "Phi-3 longrope"."""
from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    checkpoint_fused = True

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        # Phi3Config names no biases; a checkpoint with some would fail to load anyway,
        # but say why here.
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise ValueError(f"model: biases (attention_bias / mlp_bias) unsupported for "
                             f"{cls.__name__}")
