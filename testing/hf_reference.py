"""HF transformers' own model for a folder, as the numeric reference, at any transformers
version the project supports (the dtype keyword changed name in 4.56)."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.models.transformers_compat import dtype_kwarg


def hf_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32, **kwargs):
    """AutoModelForCausalLM for `path` in `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, **dtype_kwarg(dtype), **kwargs).eval()
