"""Turn a Triton `llm` request's inputs into engine arguments.

Pure Python (numpy only) so every rule here is unit-tested without a server. The
rules follow triton-inference-server/vllm_backend so its clients work unchanged,
except that values given as strings are parsed by engine/values.py, the converter
config.pbtxt parameters go through too ("false" is False, not truthy). The prompt's two
inputs are read in backend/prompt_input.py, single tensor values in backend/input_values.py.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from backend.input_values import InvalidRequest, client_value, scalar, to_bool
from backend.json_text import dotted, find_lone_surrogate
from backend.prompt_input import PROMPT_INPUTS, read_prompt
from engine.api import (GrammarCompiler, RequestOutputKind, SamplingDefaults, SamplingParams,
                        StructuredOutputsParams, check_tenant)


# vllm_backend's error text, word for word: its clients and CI tests compare it whole (the
# prompt cannot be prepended to a stream of deltas).
STREAM_WITH_INPUT_ERROR = ("Error generating stream: When streaming, `exclude_input_in_output` "
                           "= False is not allowed.")


# output_kind is not the client's: `stream` decides it (stream_output_kind).
_SAMPLING_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(SamplingParams)
                    if f.name != "output_kind"}
# vLLM parameters we accept only at the value that means "feature off", so clients
# that always send them keep working. `n` is a SamplingParams field (parallel sampling);
# best_of and beam search would rank sequences, which nothing here does.
_ONLY_DEFAULT = {"best_of": 1, "use_beam_search": False, "length_penalty": 1.0,
                 "spaces_between_special_tokens": True}
# Request-level switches a client may put in Triton request parameters (HTTP
# generate's "parameters") instead of input tensors.
_SWITCHES = ("stream", "exclude_input_in_output", "return_finish_reason",
             "return_num_input_tokens", "return_num_output_tokens",
             "return_cumulative_logprob", "return_logprobs", "return_num_cached_tokens",
             "return_max_model_len")
# vllm_backend's key since late 2025 and the older one (Triton's OpenAI frontend still
# sends it for tool_choice); the same object under either, or its JSON text.
_STRUCTURED_OUTPUT_KEYS = ("structured_outputs", "guided_decoding")
# Tokenization, not sampling, but sent where vLLM clients put per-request options
# (vLLM's completion and chat requests carry it beside the sampling fields).
_ADD_SPECIAL_TOKENS = "add_special_tokens"


@dataclass(slots=True)
class ReturnFlags:
    finish_reason: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    cumulative_logprob: bool = False
    logprobs: bool = False
    # Ours: prompt tokens found in the prefix cache (the OpenAI route's usage
    # prompt_tokens_details.cached_tokens), and the engine's resolved max_model_len.
    num_cached_tokens: bool = False
    max_model_len: bool = False


@dataclass(slots=True)
class LLMRequest:
    # The text_input; None when the prompt came as prompt_token_ids.
    prompt: str | None
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    returns: ReturnFlags
    # Under policy=priority, lower is served first (vLLM's convention); 0 by default.
    priority: int = 0
    # vLLM's switch of the same name: a text prompt gets the tokenizer's special tokens
    # (BOS), a rendered chat prompt already holds them (vLLM's chat default is False).
    add_special_tokens: bool = True
    # vllm_backend's per-request adapter (a multi_lora.json name); None: the base model.
    lora_name: str | None = None
    # The adapter's PEFT folder, for a model that takes adapters at run time
    # (backend/lora_catalog.py); None: lora_name is a configured adapter.
    lora_path: str | None = None
    # Under policy=fair, whose share it counts against; None: the tenant "default".
    tenant: str | None = None
    # Whether sampling_parameters held "logprobs": without it return_logprobs gives null
    # (vllm_backend and vLLM), though the sampled token's logprob is computed anyway.
    logprobs_asked: bool = True
    # The prompt_token_ids input, checked against the vocabulary; None for a text prompt.
    # Taken as they are (add_special_tokens does not apply), as vLLM takes token prompts.
    prompt_token_ids: list[int] | None = None


def stream_output_kind(stream: bool) -> RequestOutputKind:
    """What the engine hands out for a request of either engine model: the deltas for a
    stream, the finished output alone otherwise (its responses translate nothing else)."""
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


# INT32 as the `priority` input tensor, so the JSON key cannot hold more.
PRIORITY_RANGE = (-2**31, 2**31 - 1)


def parse_priority(value: Any) -> int:
    priority = client_value("priority", value, "int")
    if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise InvalidRequest(f"priority must be a 32-bit integer, got {priority}")
    return priority


def parse_tenant(value: Any) -> str | None:
    try:
        return check_tenant(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def parse_lora_name(value: Any, field: str = "lora_name") -> str | None:
    """vllm_backend reads lora_name out of sampling_parameters; null or absent: the base.
    (lora_path, beside it, is read the same way.)"""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{field} must be a non-empty string, got {value!r}")
    return value


def parse_sampling_parameters(params: Mapping[str, Any], ignore: tuple[str, ...] = (),
                              defaults: SamplingDefaults | None = None) -> SamplingParams:
    """JSON object (values typed or strings) -> validated SamplingParams.

    Unknown keys are errors rather than silently ignored: a typo such as
    "max_token" would otherwise change the output without a word. `defaults`: the
    engine's (the model's generation_config), which the keys left out take."""
    kwargs: dict[str, Any] = {}
    for name, value in params.items():
        if name in ignore:
            continue
        if name in _STRUCTURED_OUTPUT_KEYS:
            if value is not None:
                kwargs["structured_outputs"] = _structured_outputs(name, value, kwargs)
            continue
        if name in _ONLY_DEFAULT:
            expected = _ONLY_DEFAULT[name]
            conv = client_value(name, value, "bool" if isinstance(expected, bool) else "float")
            if conv != expected:
                raise InvalidRequest(f"sampling parameter {name!r} is not supported "
                                     f"(only {expected!r}), got {value!r}")
            continue
        if name not in _SAMPLING_FIELDS:
            raise InvalidRequest(f"unknown sampling parameter {name!r}")
        kwargs[name] = client_value(name, value, _SAMPLING_FIELDS[name])
    if defaults is not None:
        kwargs = defaults.apply(kwargs)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _structured_outputs(name: str, value: Any, kwargs: dict[str, Any]) -> StructuredOutputsParams:
    if "structured_outputs" in kwargs:
        raise InvalidRequest("send structured_outputs or guided_decoding, not both")
    try:
        return StructuredOutputsParams.from_client(name, value)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def compile_structured_output(compiler: GrammarCompiler, params: SamplingParams) -> None:
    """Check a constrained request's spec on the calling thread (Triton's execute
    thread): one over a limit (engine/structured_output/limits.py) or that xgrammar
    cannot parse is the client's error, named. Only the parse runs here (milliseconds
    within the limits); the engine compiles the token masks on its compiler's thread
    while other requests run, and finds this parse kept for it."""
    if params.structured_outputs is None:
        return
    try:
        compiler.check(params.structured_outputs)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def load_json_object(name: str, text: str | bytes) -> dict[str, Any]:
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"{name} is not valid UTF-8") from None
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{name} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    except ValueError as exc:  # e.g. an integer literal past Python's 4300-digit limit
        raise InvalidRequest(f"{name} is not valid JSON: {exc}") from None
    except RecursionError:  # ~1,000 nested arrays or objects (a JSON schema sent as one)
        raise InvalidRequest(f"{name} nests too deeply to parse") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{name} must be a JSON object, got {type(value).__name__}")
    where = _lone_surrogate(value)
    if where is not None:
        raise InvalidRequest(f"{name}: {where} holds a lone surrogate (a \\ud800-\\udfff escape "
                             "not paired), which is not Unicode text")
    return value


def _lone_surrogate(value: Any) -> str | None:
    """Where in a parsed JSON value a string (a key included) holds a lone surrogate, as
    'stop[0]' or 'key \'a\''; None if nowhere. Tokenizers and the engine would fail on it."""
    found = find_lone_surrogate(value)
    if found is None:
        return None
    path, in_key, _ = found
    if not in_key:
        return dotted(path) or "the value"
    parent = dotted(path[:-1])
    return f"key {path[-1]!r}" if not parent else f"{parent}: key {path[-1]!r}"


def _switches(inputs: Mapping[str, np.ndarray | None], req_params: Mapping[str, Any]
              ) -> dict[str, bool]:
    switches: dict[str, bool] = {}
    for name in _SWITCHES:
        if name in req_params:
            switches[name] = to_bool(name, req_params[name])
        value = scalar(name, inputs.get(name))
        if value is not None:
            switches[name] = to_bool(name, value)
    return switches


def asks_limits_only(inputs: Mapping[str, np.ndarray | None],
                     request_parameters: str | bytes = "") -> bool:
    """A request without a prompt that asks return_max_model_len: answered with the model's
    limit alone, the engine untouched (the OpenAI route's /tokenize reports it). Any other
    request without a prompt is refused by parse_llm_request."""
    if any(inputs.get(name) is not None for name in PROMPT_INPUTS):
        return False
    req_params = load_json_object("request parameters", request_parameters)
    return _switches(inputs, req_params).get("return_max_model_len", False)


def parse_llm_request(inputs: Mapping[str, np.ndarray | None], request_parameters: str | bytes = "",
                      defaults: SamplingDefaults | None = None,
                      vocab_size: int | None = None) -> LLMRequest:
    """inputs: the request's tensors by name (absent ones missing or None);
    request_parameters: Triton's request.parameters() JSON; defaults: the engine's
    sampling defaults, which the sampling keys the request leaves out take; vocab_size:
    the engine's, which every id of a prompt_token_ids prompt must be below.

    Sampling comes from the sampling_parameters input when present, otherwise from
    the request parameters (HTTP generate's "parameters" object), where the
    request-level switches (stream, exclude_input_in_output, return_*) may also
    appear; an input tensor wins over a parameter of the same name."""
    images = inputs.get("image")
    if images is not None and np.size(images) > 0:
        # vllm_backend passes these to a multimodal model; an empty tensor means none there too.
        raise InvalidRequest("this model takes text only: the 'image' input is not supported")
    prompt = read_prompt(inputs, vocab_size)

    req_params = load_json_object("request parameters", request_parameters)
    switches = _switches(inputs, req_params)

    sp_text = scalar("sampling_parameters", inputs.get("sampling_parameters"))
    sampling = load_json_object("sampling_parameters", sp_text) if sp_text is not None else req_params
    # Not a sampling parameter, but where vLLM clients put per-request options; the
    # `priority` input tensor wins.
    priority = parse_priority(sampling["priority"]) if "priority" in sampling else 0
    if (value := scalar("priority", inputs.get("priority"))) is not None:
        priority = parse_priority(value)
    add_special = to_bool(_ADD_SPECIAL_TOKENS, sampling.get(_ADD_SPECIAL_TOKENS, True))
    lora_name = parse_lora_name(sampling.get("lora_name"))
    lora_path = parse_lora_name(sampling.get("lora_path"), "lora_path")
    if lora_path is not None and lora_name is None:
        raise InvalidRequest("lora_path needs lora_name (the adapter's name)")
    tenant = parse_tenant(sampling.get("tenant"))
    params = parse_sampling_parameters(
        sampling, ignore=(*_SWITCHES, "priority", _ADD_SPECIAL_TOKENS, "lora_name",
                          "lora_path", "tenant"), defaults=defaults)

    stream = switches.get("stream", False)
    exclude = switches.get("exclude_input_in_output", stream)
    if stream and not exclude:
        raise InvalidRequest(STREAM_WITH_INPUT_ERROR)
    params.output_kind = stream_output_kind(stream)
    returns = ReturnFlags(**{f.name: switches.get(f"return_{f.name}", False)
                             for f in dataclasses.fields(ReturnFlags)})
    logprobs_asked = params.logprobs is not None
    if (returns.logprobs or returns.cumulative_logprob) and params.logprobs is None:
        # Logprobs of the sampled token cost nothing extra; cumulative_logprob needs them.
        params.logprobs = 0
    return LLMRequest(prompt.text, params, stream, exclude, returns, priority, add_special,
                      lora_name, lora_path, tenant, logprobs_asked, prompt.token_ids)
