"""HF `architectures` entry -> the class that runs it. Each family module is imported only
when a model of that family loads."""
from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# Architecture -> "module:Class" of our native implementation.
NATIVE_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "engine.models.llama:LlamaForCausalLM",
}


def native_class(arch: str) -> type[nn.Module]:
    module, _, name = NATIVE_MODELS[arch].partition(":")
    return getattr(importlib.import_module(module), name)


def model_class_for(config: Any, model_impl: str = "auto") -> type[nn.Module]:
    """The class for the config's first architecture we run; ValueError naming them if none."""
    archs = list(getattr(config, "architectures", None) or [])
    arch = next((a for a in archs if a in NATIVE_MODELS), None)
    if arch is None:
        raise ValueError(f"model: unsupported architectures {archs}; "
                         f"supported: {sorted(NATIVE_MODELS)}")
    return native_class(arch)
