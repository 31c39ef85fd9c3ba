"""The `llm` model's prompt: `text_input` (vllm_backend's, text) or `prompt_token_ids`
(ours, token ids), exactly one of the two. Pure numpy.

An id prompt is checked here, on Triton's execute thread, so a bad one is that request's
INVALID_ARG naming the field, before anything is queued: ids outside the vocabulary would
index past the model's embedding table. The bound is the engine's vocab_size (the rows the
model embeds with, which the engine checks again), not the tokenizer's length: the two
differ (Qwen2's tokenizer holds 151,665 tokens for 151,936 embedding rows), and only
the embedding decides what the model can take."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from backend.input_values import InvalidRequest, decode_text, scalar

PROMPT_INPUTS = ("text_input", "prompt_token_ids")


@dataclass(frozen=True, slots=True)
class Prompt:
    """Exactly one of the two is set."""
    text: str | None = None
    token_ids: list[int] | None = None


def read_prompt(inputs: Mapping[str, np.ndarray | None], vocab_size: int | None = None) -> Prompt:
    """`vocab_size`: the engine's; None leaves the upper bound to the engine (unit tests)."""
    text, ids = (inputs.get(name) for name in PROMPT_INPUTS)
    if text is not None and ids is not None:
        raise InvalidRequest("send the prompt as text_input or as prompt_token_ids, not both")
    if ids is not None:
        return Prompt(token_ids=read_token_ids(ids, vocab_size))
    if text is None:
        raise InvalidRequest("missing prompt: send text_input (text) or prompt_token_ids "
                             "(token ids)")
    return Prompt(text=decode_text("text_input", scalar("text_input", text)))


def read_token_ids(array: np.ndarray, vocab_size: int | None = None) -> list[int]:
    ids = np.asarray(array)
    # Triton refuses a tensor whose type differs from the config's INT64 before it gets
    # here; a caller handing numpy arrays (tests, a future model) meets the same rule.
    if ids.dtype.kind not in "iu":
        raise InvalidRequest(f"prompt_token_ids must be integer token ids (INT64), got {ids.dtype}")
    if ids.ndim == 2 and ids.shape[0] == 1:  # a client that adds a batch dimension of 1
        ids = ids[0]
    if ids.ndim != 1:
        raise InvalidRequest(f"prompt_token_ids must be a list of ids (dims [-1]), got shape "
                             f"{list(ids.shape)}")
    if ids.size == 0:
        raise InvalidRequest("prompt_token_ids must not be empty")
    # Vectorised: a max_model_len prompt is scanned in microseconds, not a Python loop.
    outside = ids < 0 if vocab_size is None else (ids < 0) | (ids >= vocab_size)
    if outside.any():
        bound = "non-negative" if vocab_size is None else f"in the vocabulary [0, {vocab_size})"
        raise InvalidRequest(f"prompt_token_ids must be ids {bound}; "
                             f"{int(outside.sum())} are not: {ids[outside][:5].tolist()}")
    return ids.tolist()  # Python ints
