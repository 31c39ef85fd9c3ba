"""Turn a Triton `llm` request's inputs into engine arguments.

Pure Python (numpy only) so every rule here is unit-tested without a server. The
rules follow triton-inference-server/vllm_backend so its clients work unchanged,
except that booleans given as strings are parsed ("false" is False, not truthy).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from engine.request import SamplingParams


class InvalidRequest(ValueError):
    """A client error: reported as INVALID_ARG, never raised past the backend."""


_SAMPLING_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(SamplingParams)}
# vLLM parameters we accept only at the value that means "feature off", so clients
# that always send them keep working.
_ONLY_DEFAULT = {"n": 1, "best_of": 1, "use_beam_search": False, "length_penalty": 1.0,
                 "spaces_between_special_tokens": True}
# Request-level switches a client may put in Triton request parameters (HTTP
# generate's "parameters") instead of input tensors.
_SWITCHES = ("stream", "exclude_input_in_output", "return_finish_reason",
             "return_num_input_tokens", "return_num_output_tokens",
             "return_cumulative_logprob", "return_logprobs")


@dataclass(slots=True)
class ReturnFlags:
    finish_reason: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    cumulative_logprob: bool = False
    logprobs: bool = False


@dataclass(slots=True)
class LLMRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    returns: ReturnFlags
    # Under policy=priority, lower is served first (vLLM's convention); 0 by default.
    priority: int = 0


# INT32 as the `priority` input tensor, so the JSON key cannot hold more.
PRIORITY_RANGE = (-2**31, 2**31 - 1)


def parse_priority(value: Any) -> int:
    priority = _to_int("priority", value)
    if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise InvalidRequest(f"priority must be a 32-bit integer, got {priority}")
    return priority


def to_bool(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
    raise InvalidRequest(f"{name} must be a boolean, got {value!r}")


def _to_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise InvalidRequest(f"{name} must be an integer, got {value!r}")


def _to_float(name: str, value: Any) -> float:
    if not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating)):
        try:
            return float(value)
        except OverflowError:
            raise InvalidRequest(f"{name} must be a finite number, got an integer too large "
                                 f"for a float") from None
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise InvalidRequest(f"{name} must be a number, got {value!r}")


def _to_list(name: str, value: Any) -> list:
    # Strings may hold a JSON list ('["a","b"]'), as string-only clients send them.
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                raise InvalidRequest(f"{name}: invalid JSON list {value!r}") from None
        else:
            # Whitespace is significant here ("\n" is a common stop string).
            value = [value] if value else []
    if not isinstance(value, list):
        raise InvalidRequest(f"{name} must be a list, got {value!r}")
    return value


def _convert(name: str, value: Any) -> Any:
    kind = _SAMPLING_FIELDS[name]
    optional = "None" in kind
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        if optional:
            return None
        raise InvalidRequest(f"sampling parameter {name!r} must not be null")
    if kind.startswith("bool"):
        return to_bool(name, value)
    if kind.startswith("int"):
        return _to_int(name, value)
    if kind.startswith("float"):
        return _to_float(name, value)
    if kind.startswith("list[str]"):
        items = _to_list(name, value)
        if not all(isinstance(s, str) for s in items):
            raise InvalidRequest(f"{name} must be a list of strings, got {value!r}")
        return items
    if kind.startswith("list[int]"):
        return [_to_int(name, v) for v in _to_list(name, value)]
    raise AssertionError(f"no converter for SamplingParams.{name}: {kind}")  # pragma: no cover


def parse_sampling_parameters(params: Mapping[str, Any], ignore: tuple[str, ...] = ()) -> SamplingParams:
    """JSON object (values typed or strings) -> validated SamplingParams.

    Unknown keys are errors rather than silently ignored: a typo such as
    "max_token" would otherwise change the output without a word."""
    kwargs: dict[str, Any] = {}
    for name, value in params.items():
        if name in ignore:
            continue
        if name in _ONLY_DEFAULT:
            expected = _ONLY_DEFAULT[name]
            conv = to_bool(name, value) if isinstance(expected, bool) else _to_float(name, value)
            if conv != expected:
                raise InvalidRequest(f"sampling parameter {name!r} is not supported "
                                     f"(only {expected!r}), got {value!r}")
            continue
        if name not in _SAMPLING_FIELDS:
            raise InvalidRequest(f"unknown sampling parameter {name!r}")
        kwargs[name] = _convert(name, value)
    try:
        return SamplingParams(**kwargs)
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
    if not isinstance(value, dict):
        raise InvalidRequest(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def scalar(name: str, array: np.ndarray | None) -> Any:
    """The single element of a [1] (or [1,1]) tensor; None when the input is absent."""
    if array is None:
        return None
    if array.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def decode_text(name: str, value: Any) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"{name} is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise InvalidRequest(f"{name} must be a string, got {type(value).__name__}")


def parse_llm_request(inputs: Mapping[str, np.ndarray | None], request_parameters: str | bytes = "") -> LLMRequest:
    """inputs: the request's tensors by name (absent ones missing or None);
    request_parameters: Triton's request.parameters() JSON.

    Sampling comes from the sampling_parameters input when present, otherwise from
    the request parameters (HTTP generate's "parameters" object), where the
    request-level switches (stream, exclude_input_in_output, return_*) may also
    appear; an input tensor wins over a parameter of the same name."""
    raw_prompt = scalar("text_input", inputs.get("text_input"))
    if raw_prompt is None:
        raise InvalidRequest("missing required input 'text_input'")
    prompt = decode_text("text_input", raw_prompt)

    req_params = load_json_object("request parameters", request_parameters)
    switches: dict[str, bool] = {}
    for name in _SWITCHES:
        if name in req_params:
            switches[name] = to_bool(name, req_params[name])
        value = scalar(name, inputs.get(name))
        if value is not None:
            switches[name] = to_bool(name, value)

    sp_text = scalar("sampling_parameters", inputs.get("sampling_parameters"))
    sampling = load_json_object("sampling_parameters", sp_text) if sp_text is not None else req_params
    # Not a sampling parameter, but where vLLM clients put per-request options; the
    # `priority` input tensor wins.
    priority = parse_priority(sampling["priority"]) if "priority" in sampling else 0
    if (value := scalar("priority", inputs.get("priority"))) is not None:
        priority = parse_priority(value)
    params = parse_sampling_parameters(sampling, ignore=(*_SWITCHES, "priority"))

    stream = switches.get("stream", False)
    exclude = switches.get("exclude_input_in_output", stream)
    if stream and not exclude:
        raise InvalidRequest("streaming requires exclude_input_in_output=true "
                             "(the prompt cannot be prepended to a stream of deltas)")
    returns = ReturnFlags(**{f.name: switches.get(f"return_{f.name}", False)
                             for f in dataclasses.fields(ReturnFlags)})
    if (returns.logprobs or returns.cumulative_logprob) and params.logprobs is None:
        # Logprobs of the sampled token cost nothing extra; asking for them is implied.
        params.logprobs = 0
    return LLMRequest(prompt, params, stream, exclude, returns, priority)
