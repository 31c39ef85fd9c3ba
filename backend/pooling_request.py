"""A pooling model's `llm` request: vllm_backend's `embedding_request` input (one JSON
object) -> the engine's pooling prompt and PoolingParams. Pure Python (numpy only).

vllm_backend's shape: {"input": <text> | [<token id>, ...], "pooling_params":
{"dimensions": [d]}} (it reads dimensions[0]); ours beside it: a list of two texts is a
cross-encoder's (text, text_pair), and pooling_params may also hold
truncate_prompt_tokens and use_activation. Every check that needs only the request runs
here, on Triton's execute thread; the model-dependent ones (Matryoshka support, a pair
on an embedder) are the engine's add_request, which refuses that request alone."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from backend.input_values import InvalidRequest, scalar, to_bool
from backend.prompt_input import read_token_ids
from backend.request_parsing import load_json_object, parse_priority
from engine.api import PoolingParams

EMBEDDING_REQUEST = "embedding_request"
_KEYS = ("input", "pooling_params")
# Inputs that only a generation request carries: refused beside embedding_request rather
# than ignored, so a client mixing the two interfaces hears it.
_GENERATION_INPUTS = ("text_input", "prompt_token_ids", "sampling_parameters", "image")
# vllm_backend's EmbedRequest answers the first three, and ours the last two as for a
# generation request; generation's other switches (exclude_input_in_output,
# return_logprobs, ...) are ignored, as vllm_backend ignores them for an embedding request.
# How much longer than what could ever fit a text may be when truncate_prompt_tokens cuts
# it: a document cut to its head is a normal request, but its text is tokenized whole on
# the engine thread (engine/pooling/inputs.py), where every other request waits on it.
TRUNCATED_TEXT_FACTOR = 16
_RETURNS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
            "return_num_cached_tokens", "return_max_model_len")


@dataclass(slots=True)
class PoolingRequest:
    # A text, token ids, or (text, text_pair) for a cross-encoder.
    prompt: str | list[int] | tuple[str, str]
    params: PoolingParams
    priority: int = 0
    # Which of _RETURNS the client switched on (input tensors or request parameters).
    returns: set[str] = field(default_factory=set)


def parse_pooling_request(inputs: Mapping[str, np.ndarray | None],
                          request_parameters: str | bytes = "",
                          vocab_size: int | None = None,
                          max_model_len: int | None = None,
                          max_text_bytes: int | None = None) -> PoolingRequest:
    """`vocab_size` and `max_model_len`: the engine's; `max_text_bytes`: the most UTF-8
    bytes that could ever fit max_model_len tokens (backend/prompt_limits.py), for each
    text, TRUNCATED_TEXT_FACTOR times that under truncate_prompt_tokens. None leaves
    those bounds to the engine (unit tests). Raises InvalidRequest naming the field."""
    sent = [name for name in _GENERATION_INPUTS if inputs.get(name) is not None]
    if sent:
        raise InvalidRequest(f"{', '.join(sent)}: a pooling request carries embedding_request "
                             "alone (its input and pooling_params)")
    text = scalar(EMBEDDING_REQUEST, inputs.get(EMBEDDING_REQUEST))
    if text is None:
        raise InvalidRequest(f"missing {EMBEDDING_REQUEST}")
    body = load_json_object(EMBEDDING_REQUEST, text if isinstance(text, (str, bytes)) else bytes(text))
    unknown = sorted(set(body) - set(_KEYS))
    if unknown:
        raise InvalidRequest(f"{EMBEDDING_REQUEST}: unknown keys {unknown}; it takes {list(_KEYS)}")
    if "input" not in body:
        raise InvalidRequest(f"{EMBEDDING_REQUEST}.input is missing")
    params = _pooling_params(body.get("pooling_params"))
    prompt = _prompt(body["input"], vocab_size)
    if (isinstance(prompt, list) and max_model_len is not None and len(prompt) > max_model_len
            and params.truncate_prompt_tokens is None):
        raise InvalidRequest(f"{EMBEDDING_REQUEST}.input holds {len(prompt)} token ids, more than "
                             f"max_model_len={max_model_len} (pooling_params."
                             "truncate_prompt_tokens cuts it)")
    if max_text_bytes is not None:
        _check_text_bytes(prompt, max_text_bytes, params.truncate_prompt_tokens is not None)
    req_params = load_json_object("request parameters", request_parameters)
    extra = sorted(set(req_params) - {*_RETURNS, "stream", "priority"})
    if extra:
        raise InvalidRequest(f"request parameters {extra}: not taken by a pooling request "
                             f"(its options go in {EMBEDDING_REQUEST}.pooling_params)")
    returns = set()
    for name in _RETURNS:
        value = scalar(name, inputs.get(name))
        if value is None:
            value = req_params.get(name, False)
        if to_bool(name, value):
            returns.add(name)
    priority = scalar("priority", inputs.get("priority"))
    if priority is None:
        priority = req_params.get("priority")
    return PoolingRequest(prompt, params, 0 if priority is None else parse_priority(priority),
                          returns)


def _check_text_bytes(prompt: Any, limit: int, truncated: bool) -> None:
    texts = [prompt] if isinstance(prompt, str) else list(prompt) if isinstance(prompt, tuple) else []
    if truncated:
        limit *= TRUNCATED_TEXT_FACTOR
    for text in texts:
        size = len(text.encode("utf-8"))
        if size > limit:
            cut = (f"{TRUNCATED_TEXT_FACTOR} times what fits, the most taken for truncation"
                   if truncated else "what could ever fit max_model_len tokens")
            raise InvalidRequest(f"{EMBEDDING_REQUEST}.input: a text of {size} bytes, more "
                                 f"than {limit} bytes ({cut})")


def _pooling_params(value: Any) -> PoolingParams:
    where = f"{EMBEDDING_REQUEST}.pooling_params"
    if value is None:
        return PoolingParams()
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be a JSON object, got {type(value).__name__}")
    values = dict(value)
    dims = values.get("dimensions")
    # vllm_backend sends dimensions as a list and reads its first item.
    if isinstance(dims, list):
        if len(dims) != 1:
            raise InvalidRequest(f"{where}.dimensions: one value (or a list of one), got {dims!r}")
        values["dimensions"] = dims[0]
    if values.get("dimensions", 0) is None:
        del values["dimensions"]
    try:
        return PoolingParams.from_dict(values)
    except ValueError as exc:
        raise InvalidRequest(f"{where}: {exc}") from None


def _prompt(value: Any, vocab_size: int | None) -> str | list[int] | tuple[str, str]:
    where = f"{EMBEDDING_REQUEST}.input"
    if isinstance(value, str):
        if not value:
            raise InvalidRequest(f"{where} is empty")
        return value
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"{where} must be a non-empty string, a list of token ids or a "
                             f"[text_1, text_2] pair, got {_shown(value)}")
    if all(isinstance(item, str) for item in value):
        if len(value) != 2 or not all(value):
            raise InvalidRequest(f"{where}: a list of texts is a cross-encoder's pair "
                                 f"[text_1, text_2] of two non-empty texts, got {len(value)} texts")
        return value[0], value[1]
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        raise InvalidRequest(f"{where}: a list must hold token ids (integers) or two texts")
    try:
        return read_token_ids(np.array(value, dtype=np.int64), vocab_size)
    except OverflowError:
        raise InvalidRequest(f"{where}: token ids must fit in 64 bits") from None
    except InvalidRequest as exc:
        raise InvalidRequest(str(exc).replace("prompt_token_ids", where, 1)) from None


def _shown(value: Any) -> str:
    return "an empty list" if value == [] else type(value).__name__
