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
    "Qwen3ForCausalLM": "engine.models.qwen3:Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "engine.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "engine.models.gemma:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "engine.models.phi3:Phi3ForCausalLM",
    "MixtralForCausalLM": "engine.models.mixtral:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "engine.models.qwen3_moe:Qwen3MoeForCausalLM",
    "GptOssForCausalLM": "engine.models.gpt_oss:GptOssForCausalLM",
}

# Encoders for the pooling runner only (engine/config/runner.py ENCODER_TASKS names the
# task of each); never picked for generation.
POOLING_MODELS: dict[str, str] = {
    arch: "engine.models.bert:BertPoolingModel" for arch in (
        "BertModel", "RobertaModel", "XLMRobertaModel", "BertForSequenceClassification",
        "RobertaForSequenceClassification", "XLMRobertaForSequenceClassification")}


def pooling_class(arch: str) -> type[nn.Module]:
    module, _, name = POOLING_MODELS[arch].partition(":")
    return getattr(importlib.import_module(module), name)


def native_class(arch: str) -> type[nn.Module]:
    module, _, name = NATIVE_MODELS[arch].partition(":")
    return getattr(importlib.import_module(module), name)


def model_class_for(config: Any, model_impl: str = "auto") -> type[nn.Module]:
    """The class that runs the config's architecture (vLLM's model_impl): "auto" the native
    one where NATIVE_MODELS has it, else transformers' own modeling code over the paged
    cache (engine/models/transformers_backend.py) where the architecture qualifies;
    "native" / "transformers" insist on one. ValueError naming the architecture and why
    when nothing runs it."""
    archs = list(getattr(config, "architectures", None) or [])
    native = next((a for a in archs if a in NATIVE_MODELS), None)
    if model_impl not in ("auto", "native", "transformers"):
        raise ValueError(f"model_impl: expected 'auto', 'native' or 'transformers', "
                         f"got {model_impl!r}")
    if native is not None and model_impl != "transformers":
        return native_class(native)
    if model_impl == "native":
        raise ValueError(f"model: no native implementation of {archs} (model_impl='native'); "
                         f"native: {sorted(NATIVE_MODELS)}; model_impl='auto' or 'transformers' "
                         "runs other architectures through transformers' modeling code")
    # Imported here: it registers our attention with transformers on import.
    from engine.models import transformers_backend

    reason = transformers_backend.why_not(config)
    if reason is None:
        return transformers_backend.TransformersForCausalLM
    if model_impl == "transformers":
        raise ValueError(f"model: {archs} cannot run with model_impl='transformers': {reason}")
    raise ValueError(f"model: unsupported architectures {archs}: no native implementation "
                     f"(native: {sorted(NATIVE_MODELS)}) and not on the general path: {reason}")
