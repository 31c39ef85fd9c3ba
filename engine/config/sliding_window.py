"""Which layers of a model attend through a sliding window, and how wide: one answer for
the model (its attention layers), the KV-cache manager (its groups of layers) and the
context limit. Reads the HF config only, so the scheduler side needs no torch."""
from __future__ import annotations

from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"


def layer_windows(hf_config: Any, disable_sliding_window: bool = False) -> list[int | None]:
    """Per layer: the window W (a query at position p sees keys p-W+1 .. p, HF's and
    vLLM's meaning) or None for full attention.

    Sources, in order: `layer_types` (transformers >= 4.53 writes it for Gemma 2/3,
    Qwen2/3, ...); Gemma 3's `sliding_window_pattern` and Gemma 2's alternation in
    configs that predate it; else every layer is windowed when `sliding_window` is set
    and the config does not turn it off (`use_sliding_window`, Qwen's switch).
    `disable_sliding_window` (vLLM's engine argument): every layer full."""
    num_layers = int(hf_config.num_hidden_layers)
    window = getattr(hf_config, "sliding_window", None)
    if disable_sliding_window or not window:
        return [None] * num_layers
    window = int(window)
    kinds = getattr(hf_config, "layer_types", None)
    if kinds is None:
        kinds = _kinds_before_layer_types(hf_config, num_layers)
    if len(kinds) != num_layers:
        raise ValueError(f"config: layer_types has {len(kinds)} entries for "
                         f"{num_layers} layers")
    unknown = sorted({k for k in kinds if k not in (FULL, SLIDING)})
    if unknown:
        raise ValueError(f"config: layer_types {unknown} unsupported "
                         f"(supported: {FULL!r}, {SLIDING!r})")
    return [window if kind == SLIDING else None for kind in kinds]


def _kinds_before_layer_types(hf_config: Any, num_layers: int) -> list[str]:
    model_type = getattr(hf_config, "model_type", "")
    if model_type == "gemma2":  # even layers local, odd global
        return [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    pattern = getattr(hf_config, "sliding_window_pattern", None)
    if model_type.startswith("gemma3") and pattern:  # every pattern-th layer global
        return [FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(num_layers)]
    if not getattr(hf_config, "use_sliding_window", True):
        return [FULL] * num_layers
    first = int(getattr(hf_config, "max_window_layers", 0) or 0)
    if model_type.startswith("qwen") and first:  # Qwen: layers from max_window_layers on
        return [SLIDING if i >= first else FULL for i in range(num_layers)]
    return [SLIDING] * num_layers


def max_context(hf_config: Any, disable_sliding_window: bool = False) -> int:
    """The longest context the model handles: its positions, not its window; with the
    window disabled (full attention where the model was trained windowed) it is capped
    at the window, as vLLM caps max_model_len."""
    limit = int(hf_config.max_position_embeddings)
    window = getattr(hf_config, "sliding_window", None)
    if disable_sliding_window and window and any(layer_windows(hf_config)):
        limit = min(limit, int(window))
    return limit
