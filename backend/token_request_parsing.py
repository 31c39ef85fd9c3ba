"""TensorRT-LLM-named token-id inputs (the `tensorrt_llm` model) -> engine arguments.

Pure numpy. Inputs arrive with a leading batch dimension (max_batch_size > 0), and
one decoupled request carries one sequence, so the batch must be 1. Sampling follows
TensorRT-LLM's meaning of its knobs: greedy unless top_k > 1 or top_p > 0."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from backend.input_values import InvalidRequest, decode_text, scalar, to_bool
from backend.request_parsing import (parse_lora_name, parse_priority, parse_tenant,
                                     stream_output_kind)
from engine.api import SamplingDefaults, SamplingParams


@dataclass(slots=True)
class TokenRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    end_id: int | None
    priority: int = 0
    lora_name: str | None = None  # a multi_lora.json name; None: the base model
    tenant: str | None = None  # under policy=fair; None: the tenant "default"


def words_from_trtllm_list(name: str, array: np.ndarray | None) -> list[list[int]]:
    """TensorRT-LLM's [batch, 2, L] word list: row 0 the concatenated ids, row 1 the
    end offset of each word, padded with -1."""
    if array is None or array.size == 0:
        return []
    arr = np.asarray(array)
    if arr.ndim == 3:
        if arr.shape[0] != 1:
            raise InvalidRequest(f"{name}: batch size must be 1, got {arr.shape[0]}")
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[0] != 2:
        raise InvalidRequest(f"{name} must have shape [2, L], got {list(array.shape)}")
    ids, offsets = arr[0].tolist(), [int(o) for o in arr[1].tolist() if o >= 0]
    words, start = [], 0
    for end in offsets:
        if end <= start or end > len(ids):
            raise InvalidRequest(f"{name}: offsets must be increasing and within the id row")
        words.append([int(t) for t in ids[start:end]])
        start = end
    return words


def _opt(inputs: Mapping[str, np.ndarray | None], name: str) -> Any:
    return scalar(name, inputs.get(name))


def parse_token_request(inputs: Mapping[str, np.ndarray | None],
                        defaults: SamplingDefaults | None = None) -> TokenRequest:
    """`defaults`: the engine's sampling defaults (the model's generation_config), which
    the knobs a request leaves out take. Whether it samples at all stays TensorRT-LLM's
    decision (its top_k / top_p inputs); a greedy request still takes the model's penalties."""
    ids = inputs.get("input_ids")
    if ids is None:
        raise InvalidRequest("missing required input 'input_ids'")
    ids = np.asarray(ids)
    if ids.ndim == 2:
        if ids.shape[0] != 1:
            raise InvalidRequest(f"input_ids: batch size must be 1 per request, got {ids.shape[0]}")
        ids = ids[0]
    prompt = [int(t) for t in ids.reshape(-1).tolist()]
    length = _opt(inputs, "input_lengths")
    if length is not None:
        if not 0 < int(length) <= len(prompt):
            raise InvalidRequest(f"input_lengths {int(length)} outside 1..{len(prompt)}")
        prompt = prompt[:int(length)]
    if not prompt:
        raise InvalidRequest("input_ids must not be empty")
    if min(prompt) < 0:
        raise InvalidRequest("input_ids must be non-negative token ids")

    max_tokens = _opt(inputs, "request_output_len")
    if max_tokens is None:
        raise InvalidRequest("missing required input 'request_output_len' (max_tokens)")
    beam_width = _opt(inputs, "beam_width")
    if beam_width is not None and int(beam_width) != 1:
        raise InvalidRequest(f"beam_width must be 1 (beam search is not supported), got {int(beam_width)}")
    if words_from_trtllm_list("bad_words_list", inputs.get("bad_words_list")):
        raise InvalidRequest("bad_words is not supported; send it empty")
    stop_words = words_from_trtllm_list("stop_words_list", inputs.get("stop_words_list"))

    top_k = _opt(inputs, "runtime_top_k")
    top_p = _opt(inputs, "runtime_top_p")
    temperature = _opt(inputs, "temperature")
    seeds = {name: int(v) for name in ("random_seed", "seed") if (v := _opt(inputs, name)) is not None}
    if len(set(seeds.values())) > 1:
        raise InvalidRequest(f"seed and random_seed disagree: {seeds}")
    sampling = (top_k is not None and int(top_k) > 1) or (top_p is not None and float(top_p) > 0)
    end_id = _opt(inputs, "end_id")
    stream = to_bool("streaming", v) if (v := _opt(inputs, "streaming")) is not None else False
    kwargs: dict[str, Any] = dict(
        max_tokens=int(max_tokens),
        min_tokens=int(_opt(inputs, "min_length") or 0),
        seed=next(iter(seeds.values()), None),
        # Matched as ids, as TensorRT-LLM does; the stop word stays in the output.
        stop_token_sequences=stop_words,
        output_kind=stream_output_kind(stream),
    )
    if not sampling:  # greedy, whatever the model's defaults say
        kwargs.update(temperature=0.0, top_k=0, top_p=1.0)
    else:  # the knobs given; TensorRT-LLM's top_k <= 1 and top_p <= 0 mean "off"
        if temperature is not None:
            kwargs["temperature"] = float(temperature)
        if top_k is not None:
            kwargs["top_k"] = int(top_k) if int(top_k) > 1 else 0
        if top_p is not None:
            kwargs["top_p"] = float(top_p) if float(top_p) > 0 else 1.0
    if end_id is not None:
        kwargs["stop_token_ids"] = [int(end_id)]
    if defaults is not None:
        kwargs = defaults.apply(kwargs)
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    exclude = (to_bool("exclude_input_in_output", v)
               if (v := _opt(inputs, "exclude_input_in_output")) is not None else False)
    priority = parse_priority(v) if (v := _opt(inputs, "priority")) is not None else 0
    lora = _opt(inputs, "lora_name")
    lora_name = None if lora is None else parse_lora_name(decode_text("lora_name", lora) or None)
    tenant = _opt(inputs, "tenant")
    # An ensemble client that fills every input sends "" for none.
    tenant = None if tenant is None else parse_tenant(decode_text("tenant", tenant) or None)
    return TokenRequest(prompt, params, stream, exclude, None if end_id is None else int(end_id),
                        priority, lora_name, tenant)
