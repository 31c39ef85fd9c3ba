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


def hf_greedy_ids(path: str | Path, prompt_ids_list: list[list[int]],
                  max_new_tokens: int) -> list[list[int]]:
    """HF generate's greedy continuation of each prompt (float32, eager attention), EOS
    neither stopping nor masked: what the engine gives with temperature 0 and ignore_eos."""
    model = hf_causal_lm(path, torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    outs = []
    for ids in prompt_ids_list:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs
