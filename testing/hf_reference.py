"""HF transformers' own model for a folder, as the numeric reference, at any transformers
version the project supports: the dtype keyword was `torch_dtype` before 4.56 and is
`dtype` after (the old name warns there)."""
from __future__ import annotations

from pathlib import Path

import torch


def dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    import transformers
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


def hf_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32, **kwargs):
    """AutoModelForCausalLM for `path` in `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, **dtype_kwarg(dtype), **kwargs).eval()
