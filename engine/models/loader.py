"""load_model: HF folder, .gguf file or the embedded default -> our paged-attention model."""
from __future__ import annotations

import copy
import glob
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from engine.config.sliding_window import layer_windows, max_context
from engine.models.llama import head_dim_of
from engine.models.registry import model_class_for
from engine.models.model_files import load_tokenizer, resolve_model_dir
from kernels.dispatch import detect_cpu

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "fp32": torch.float32, "float": torch.float32}


@dataclass
class LoadedModel:
    model: nn.Module
    hf_config: Any
    tokenizer: Any
    model_dir: Path
    dtype: torch.dtype
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    # The longest context the model handles: its positions (capped at the window only
    # under disable_sliding_window).
    max_position_embeddings: int
    # Per layer, its attention window or None for full attention.
    sliding_windows: list[int | None] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    load_seconds: float = 0.0

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def kv_cache_bytes_per_token(self) -> int:
        """K and V for one token across all layers, in the model dtype."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def resolve_dtype(dtype: torch.dtype | str | None, config: Any,
                  device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype to run in. "auto" means vLLM's rule on a GPU (keep a half-precision
    checkpoint's dtype, run fp32 checkpoints in bf16) and the CPU's rule on a CPU: bf16
    where the CPU computes it natively, float32 where bf16 would be emulated (AVX2: ~4x
    slower matmuls at batch 64, measured)."""
    if isinstance(dtype, str) and dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"dtype: unsupported value {dtype!r}; use one of {sorted(_DTYPES)}")
    on_cpu = torch.device(device).type == "cpu"
    features = detect_cpu()
    if isinstance(dtype, torch.dtype) or (dtype is not None and dtype != "auto"):
        chosen = dtype if isinstance(dtype, torch.dtype) else _DTYPES[dtype]
        if on_cpu and chosen != torch.float32 and not features.native_bf16:
            logger.warning("dtype %s on a CPU without native half-precision dot products (%s): "
                           "matmuls are emulated and run several times slower than float32; "
                           "dtype=auto picks float32 here", _name(chosen), features.describe())
        return chosen
    if on_cpu:
        chosen = torch.bfloat16 if features.native_bf16 else torch.float32
        why = "the CPU computes bf16 natively" if features.native_bf16 else "CPU has no native bf16"
        logger.info("dtype auto -> %s: %s (%s)", _name(chosen), why, features.describe())
        return chosen
    ckpt = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt)
    chosen = ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16
    logger.info("dtype auto -> %s on %s (checkpoint: %s)", _name(chosen), device, ckpt)
    return chosen


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def iter_checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(str(model_dir / "*.safetensors")))
    if files:
        from safetensors import safe_open
        for f in files:
            with safe_open(f, framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        return
    bins = sorted(glob.glob(str(model_dir / "pytorch_model*.bin")))
    if not bins:
        raise ValueError(f"model: no *.safetensors or pytorch_model*.bin in {str(model_dir)!r}")
    for f in bins:
        yield from torch.load(f, map_location="cpu", weights_only=True, mmap=True).items()


def eos_token_ids(model_dir: Path, config: Any, tokenizer: Any) -> list[int]:
    """The ids HF `generate` stops on: generation_config.json first, then config, then tokenizer.

    Sources are not merged, as in `generate`: a chat model's tokenizer may name a different
    special token than the one the model ends its turns with."""
    candidates: list[Any] = []
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        candidates.append(json.loads(gen_path.read_text(encoding="utf-8")).get("eos_token_id"))
    candidates.append(getattr(config, "eos_token_id", None))
    candidates.append(getattr(tokenizer, "eos_token_id", None))
    for value in candidates:
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else list(value)
        if ids:
            return [int(i) for i in dict.fromkeys(ids)]
    return []


def _quantize(net: nn.Module, model: str | os.PathLike | None, quantization: str,
              device: str | torch.device) -> None:
    from engine.models.gguf_cache import default_gguf_path
    from engine.models.gguf_weights import load_quantized
    from kernels import dispatch

    if quantization != "gguf":
        raise ValueError(f"quantization: unsupported value {quantization!r} (supported: gguf)")
    source = default_gguf_path() if model is None or not os.fspath(model) else Path(model)
    if source.suffix != ".gguf":
        raise ValueError(f"quantization 'gguf' needs a .gguf model, got {str(model)!r}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantization 'gguf' runs on the CPU only, not on {device}")
    if not dispatch.gguf_kernel_available():
        logger.warning("quantization gguf: the native CPU kernels are unavailable (no C "
                       "compiler, or the build failed), so the weights stay dequantized")
        return
    weights = load_quantized(source, net)
    net.quantize(weights)
    logger.info("quantization gguf: %d weight tables kept in their GGUF blocks (%.0f MB)",
                len(weights), sum(w.nbytes for w in {id(w): w for w in weights.values()}.values()) / 1e6)


def load_model(model: str | os.PathLike | None, dtype: torch.dtype | str | None = "auto",
               tokenizer: str | os.PathLike | None = None,
               device: str | torch.device = "cpu", quantization: str | None = None,
               batch_invariant: bool = False, model_impl: str = "auto",
               disable_sliding_window: bool = False) -> LoadedModel:
    """Build our model from `model` (HF folder, .gguf file, or None for the embedded default).

    `tokenizer`: a folder to take the tokenizer from instead of the model's.
    `quantization`: None (weights in `dtype`) or "gguf" (a GGUF model's Q4_0/Q4_1/Q8_0
    tensors stay in their blocks; CPU only). `batch_invariant`: kernels whose per-row
    results do not depend on the batch (LlamaForCausalLM.prepack). `model_impl`: which
    implementation runs it (engine/models/registry.py). `disable_sliding_window`: every
    layer attends to the whole context, the context capped at the window."""
    from transformers import AutoConfig

    start = time.perf_counter()
    model_dir = resolve_model_dir(model)
    config = AutoConfig.from_pretrained(model_dir)
    # First: an architecture no path runs is refused by name before anything reads the
    # config as a decoder's.
    model_class = model_class_for(config, model_impl)
    if quantization is not None and not getattr(model_class, "supports_quantization", True):
        raise ValueError(f"quantization {quantization!r}: {config.architectures} runs as "
                         f"{model_class.__name__}, which takes no GGUF weights")
    context = max_context(config, disable_sliding_window)
    if disable_sliding_window:
        # The models read their windows from the config (engine/config/sliding_window.py).
        config = copy.deepcopy(config)
        config.sliding_window = None
    torch_dtype = resolve_dtype(dtype, config, device)
    net = model_class(config, torch_dtype)
    with torch.no_grad():
        net.load_weights(iter_checkpoint_tensors(model_dir))
    net.eval()
    net.to(device)
    if quantization is not None:
        _quantize(net, model, quantization, device)
    net.prepack(batch_invariant)  # CPU only; a no-op elsewhere
    tok = load_tokenizer(model_dir, tokenizer)
    return LoadedModel(
        model=net, hf_config=config, tokenizer=tok, model_dir=model_dir,
        dtype=torch_dtype, num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim_of(config), hidden_size=config.hidden_size,
        vocab_size=config.vocab_size, max_position_embeddings=context,
        sliding_windows=layer_windows(config),
        eos_token_ids=eos_token_ids(model_dir, config, tok),
        load_seconds=time.perf_counter() - start)
