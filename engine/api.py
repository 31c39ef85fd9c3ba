"""The engine's one public surface: every engine name that backend/, openai_frontend/,
tuning/ and scripts/ use, and the offline API users import from `engine` (which
re-exports this module whole). Code above the engine imports from here or from `engine`,
never from an engine module (tests/test_engine_surface.py checks it), so the engine's
modules can move without touching its callers.

Importing it stays cheap and torch-free: the tokenizer-only Triton models, the tuning
tools and the scheduler tests import it on hosts or in processes without torch. Names
behind torch or transformers are resolved on first use (`__getattr__` below)."""
from __future__ import annotations

import importlib

# Config strings (config.pbtxt, CLI, JSON) -> typed values, the one converter.
from engine.values import convert, to_bool

# Engine configuration, a section per class, built once by EngineConfig.from_dict.
from engine.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from engine.config.generation import SamplingDefaults

# A request's parameters and how its outputs are released.
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from engine.lora.request import LoRARequest
from engine.core.fair_share import check_tenant
from engine.structured_output.grammar import GrammarCompiler

# What the engine hands back, and how many prompt ids detokenizing a continuation needs.
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.output.detokenizer import CONTEXT_TOKENS

# The pooling runner's request parameters and outputs (vLLM's names; torch-free).
from engine.pooling.params import PoolingParams
from engine.pooling.outputs import (EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                                    PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)

# The scheduler without a model: tests, the replay and the router simulation.
from engine.core.request import Request, RequestStatus
from engine.core.sched_output import SchedulerOutput, SchedulerStats
from engine.core.scheduler import Scheduler
from engine.core.kv_cache.groups import KVCacheLayout, build_layout
from engine.metrics.trace import step_features

# KV-cache events as they go on the wire, for routers that mirror a replica's cache.
from engine.core.kv_cache import BlockHasher, external_hash
from engine.core.kv_cache.publisher import encode_batch

# Test-only failure switches, split off a model's parameters before its config is built.
from engine.faults import take_fault_parameters

# Resolved on first use: the model-backed engine and offline LLM import torch; the model
# file helpers live in the models package, torch-free today only through its own lazy
# names, so this module does not bet its import cost on that package staying so.
_LAZY = {
    "LLMEngine": "engine.llm_engine",
    "LLM": "engine.llm",
    "load_tokenizer": "engine.models.model_files",
    "resolve_model_dir": "engine.models.model_files",
    "tokenizer_dir": "engine.models.model_files",
}

__all__ = sorted([
    "convert", "to_bool",
    "CacheConfig", "EngineConfig", "LoRAConfig", "SamplingDefaults", "SchedulerConfig",
    "LoRARequest", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams",
    "GrammarCompiler", "check_tenant",
    "CONTEXT_TOKENS", "CompletionOutput", "Logprob", "RequestOutput",
    "PoolingParams", "EmbeddingOutput", "EmbeddingRequestOutput", "PoolingOutput",
    "PoolingRequestOutput", "ScoringOutput", "ScoringRequestOutput",
    "KVCacheLayout", "Request", "RequestStatus", "Scheduler", "SchedulerOutput",
    "SchedulerStats", "build_layout", "step_features",
    "BlockHasher", "encode_batch", "external_hash",
    "take_fault_parameters",
    *_LAZY,
])


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
