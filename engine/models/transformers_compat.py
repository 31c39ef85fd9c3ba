"""What differs between the transformers versions the project supports (pyproject.toml's
floor to the pinned one), in one place."""
from __future__ import annotations

import torch


def dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The keyword that sets a model's dtype in from_pretrained / _from_config: `dtype`
    from transformers 4.56, `torch_dtype` before (where `dtype` is passed on to the
    model's __init__ and fails)."""
    import transformers
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
