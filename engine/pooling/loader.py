"""Loading a model for the pooling runner: a BERT-family encoder (engine/models/bert.py),
or a causal LM of any family the engine runs, whose final hidden states get pooled.

Embedding checkpoints of causal LMs often ship as the base model alone (Qwen3-Embedding,
e5-mistral: tensors named `layers.N...`, no lm_head), so for the native families the
names get the `model.` prefix back and the lm_head is neither loaded nor required (it is
never used: pooling computes no logits). The general path (transformers' classes) already
takes base-model names; it still loads a causal-LM checkpoint whole.

This repeats engine/models/loader.py load_model's few steps rather than call it, because
those two differences sit inside it; a `load_model(..., model_class=, weights=)` hook
there would let this file shrink to the encoder case."""
from __future__ import annotations

import copy
import time
from typing import Iterable, Iterator

import torch

from engine.config import EngineConfig
from engine.config.runner import RunnerChoice
from engine.config.sliding_window import layer_windows, max_context
from engine.models.bert import max_positions
from engine.models.llama import LlamaForCausalLM, head_dim_of
from engine.models.loader import (LoadedModel, eos_token_ids, iter_checkpoint_tensors,
                                  resolve_dtype)
from engine.models.model_files import load_tokenizer, resolve_model_dir
from engine.models.registry import POOLING_MODELS, model_class_for, pooling_class


def load_pooling_model(config: EngineConfig, choice: RunnerChoice) -> LoadedModel:
    from transformers import AutoConfig

    start = time.perf_counter()
    model_dir = resolve_model_dir(config.model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    device = config.torch_device
    if choice.encoder:
        arch = next(a for a in hf_config.architectures if a in POOLING_MODELS)
        model_class = pooling_class(arch)
        context = max_positions(hf_config)
        windows: list[int | None] = [None] * hf_config.num_hidden_layers
    else:
        model_class = model_class_for(hf_config, config.model_impl)
        context = max_context(hf_config, config.disable_sliding_window)
        if config.disable_sliding_window:
            hf_config = copy.deepcopy(hf_config)
            hf_config.sliding_window = None
        windows = layer_windows(hf_config)
    dtype = resolve_dtype(config.dtype, hf_config, device)
    net = model_class(hf_config, dtype)
    weights: Iterable = iter_checkpoint_tensors(model_dir)
    if isinstance(net, LlamaForCausalLM):
        _drop_lm_head(net)
        weights = _as_causal_lm_names(weights)
    with torch.no_grad():
        net.load_weights(weights)
    net.eval()
    net.to(device)
    net.prepack(False)  # CPU only; a no-op elsewhere
    tokenizer = load_tokenizer(model_dir, config.tokenizer)
    return LoadedModel(
        model=net, hf_config=hf_config, tokenizer=tokenizer, model_dir=model_dir,
        dtype=dtype, num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None)
        or hf_config.num_attention_heads,
        head_dim=head_dim_of(hf_config), hidden_size=hf_config.hidden_size,
        vocab_size=hf_config.vocab_size, max_position_embeddings=context,
        sliding_windows=windows, eos_token_ids=eos_token_ids(model_dir, hf_config, tokenizer),
        load_seconds=time.perf_counter() - start)


def _drop_lm_head(net: LlamaForCausalLM) -> None:
    # Pooling reads the final norm's output; the vocabulary projection is dead weight
    # (vocab x hidden). Marked tied, the loader skips an lm_head tensor and does not ask
    # for one; the parameter goes.
    net.tie_word_embeddings = True
    net.lm_head_weight = None


def _as_causal_lm_names(weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        yield (name if name.startswith("model.") else "model." + name), tensor
