"""Single values out of a Triton request's tensors, and the client error every request
parser raises. Pure numpy: the `llm` parser (backend/request_parsing.py), its prompt
(backend/prompt_input.py), the token-id parser and the tokenizer models share these."""
from __future__ import annotations

from typing import Any

import numpy as np

from backend.json_text import find_lone_surrogate
from engine.api import convert


class InvalidRequest(ValueError):
    """A client error: reported as INVALID_ARG, never raised past the backend."""


def client_value(name: str, value: Any, kind: str) -> Any:
    """engine.values.convert, its error reported as the client's (INVALID_ARG)."""
    try:
        return convert(name, value, kind)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def to_bool(name: str, value: Any) -> bool:
    return client_value(name, value, "bool")


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
        if find_lone_surrogate(value) is not None:
            raise InvalidRequest(f"{name} holds a lone surrogate (a \\ud800-\\udfff escape "
                                 "not paired), which is not Unicode text")
        return value
    raise InvalidRequest(f"{name} must be a string, got {type(value).__name__}")
