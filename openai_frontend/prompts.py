"""The completions `prompt` in the four forms vLLM takes: a text, a batch of texts, one
prompt of token ids, or a batch of id prompts. Anything else (a list mixing texts and
ids, an empty prompt, a negative id, a boolean or a float for an id) is a 400 naming
`prompt` before anything reaches Triton. An id at or past the vocabulary is the `llm`
model's to refuse: only it knows the bound the engine embeds with."""
from __future__ import annotations

from typing import Any, Union

from openai_frontend.errors import bad_request

# A text, or token ids (the `llm` model's prompt_token_ids).
Prompt = Union[str, list[int]]

# prompt_token_ids is INT64: an id past it cannot even be sent (nor be in any vocabulary).
_INT64_END = 2**63
_FORMS = ("prompt must be a string, a list of strings, a list of token ids or a list of "
          "lists of token ids")


def split_prompts(value: Any) -> list[Prompt]:
    """The request's prompts, one per `llm` request."""
    if isinstance(value, str):
        prompts: list[Prompt] = [value]
    elif not isinstance(value, list):
        raise bad_request(f"{_FORMS}, got {type(value).__name__}", "prompt")
    elif not value:
        raise bad_request("prompt must not be empty", "prompt")
    elif all(isinstance(p, str) for p in value):
        prompts = list(value)
    elif all(_is_id(t) for t in value):
        prompts = [list(value)]
    elif all(isinstance(p, list) for p in value):
        for i, ids in enumerate(value):
            if not all(_is_id(t) for t in ids):
                raise bad_request(f"prompt[{i}] must be a list of token ids (integers)", "prompt")
        prompts = [list(ids) for ids in value]
    else:
        raise bad_request(f"{_FORMS}, not a mix of them", "prompt")
    for i, prompt in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not prompt:
            raise bad_request(f"{where} must not be empty", "prompt")
        if isinstance(prompt, list) and min(prompt) < 0:
            raise bad_request(f"{where}: token ids must be non-negative, got {min(prompt)}",
                              "prompt")
        if isinstance(prompt, list) and max(prompt) >= _INT64_END:
            raise bad_request(f"{where}: token id {max(prompt)} is past any vocabulary", "prompt")
    return prompts


def _is_id(value: Any) -> bool:
    # JSON true would pass as 1 and 2.0 as 2 under Python's and pydantic's leniency.
    return isinstance(value, int) and not isinstance(value, bool)
