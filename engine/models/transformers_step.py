"""The forward in progress on the general path (transformers_backend.py), as the code HF
calls deep inside its own modules reads it: our attention function and the kernel swaps
of transformers_kernels.py. A module of its own so both import it and neither imports the
other."""
from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

import torch

from engine.models.attention import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class Step:
    """What the attention layers need of the forward in progress. HF calls the
    attention function deep inside its own code, so this travels in a context variable
    rather than through HF's kwargs (not every architecture threads them to every layer)."""
    kv_caches: list[KVCache]
    metas: list[AttentionMetadata]
    windows: list[int | None]
    architecture: str
    # id(cos) -> (cos, sin, the native rope's tables or None): HF computes cos/sin once
    # a forward and hands the same tensors to every layer (transformers_kernels._native_rope).
    rope_tables: dict[int, tuple] = field(default_factory=dict)
    # A forward that only records which linears share an input
    # (transformers_kernels._shared_input_groups):
    # attention answers zeros and touches no cache.
    tracing: bool = False


CURRENT_STEP: contextvars.ContextVar[Step | None] = contextvars.ContextVar("engine_paged_step",
                                                                    default=None)
