"""OpenAI error objects, and which HTTP status a Triton error deserves.

Errors on a gRPC stream carry only Triton's message, not its status code (the
`triton_grpc_error` header would carry the code, but Triton 2.51 logs a warning for every
such stream and crashed once in a few runs under it: tests/e2e/test_llm_overload.py), so
a stream error is classified by what the `llm` backend says (backend/engine_loop.py,
backend/engine_model.py). Its rule: a request it refuses for what the request holds is
INVALID_ARG, so anything not recognised as overload or a server fault is the client's."""
from __future__ import annotations

import re
from typing import Any

# Fragments of the messages the backend and Triton send with UNAVAILABLE (overload, a
# dead engine loop, a model going away) and with INTERNAL (a failed engine step).
_UNAVAILABLE = ("server busy", "engine stopped", "was unloaded", "unknown model",
                "is not ready", "unavailable", "request was cancelled")
_INTERNAL = ("engine step failed", "engine rejected the request", "response building failed",
             "engine dropped the request")
# gRPC status codes (InferenceServerException.status() for errors of the call itself,
# e.g. the server unreachable) -> HTTP.
_GRPC_STATUS = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 503, "UNAVAILABLE": 503,
                "RESOURCE_EXHAUSTED": 503, "CANCELLED": 503, "DEADLINE_EXCEEDED": 504,
                "UNIMPLEMENTED": 501}
# Engine parameter named in a backend message -> the OpenAI parameter a client sent.
_PARAM_NAMES = {"max_tokens": "max_tokens", "structured_outputs": "response_format",
                "guided_decoding": "response_format", "text_input": "prompt",
                "prompt_token_ids": "prompt"}
_PARAM_PATTERNS = (re.compile(r"SamplingParams\.(\w+)"), re.compile(r"sampling parameter '(\w+)'"),
                   re.compile(r"^(structured_outputs|guided_decoding)\b"),
                   re.compile(r"^(\w+) (?:must|is|needs)\b"))


class APIError(Exception):
    """An error to answer with: HTTP status plus OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        if self.status < 500:
            return "invalid_request_error"
        return "service_unavailable_error" if self.status == 503 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_parameter")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model",
                    code="model_not_found")


def from_triton(exc: BaseException) -> APIError:
    """tritonclient's InferenceServerException (or anything raised talking to Triton)."""
    message = exc.message() if hasattr(exc, "message") and callable(exc.message) else str(exc)
    status = exc.status() if hasattr(exc, "status") and callable(exc.status) else None
    if status:
        http = _GRPC_STATUS.get(str(status).rsplit(".", 1)[-1], 500)
        return _server_error(http, message) if http >= 500 else bad_request(message, _param(message))
    lowered = message.lower()
    if any(fragment in lowered for fragment in _UNAVAILABLE):
        return _server_error(503, message)
    if any(fragment in lowered for fragment in _INTERNAL):
        return _server_error(500, message)
    return bad_request(message, _param(message))


def _server_error(status: int, message: str) -> APIError:
    code = "service_unavailable" if status == 503 else "internal_error"
    return APIError(status, message, code=code)


def _param(message: str) -> str | None:
    for pattern in _PARAM_PATTERNS:
        found = pattern.search(message)
        if found:
            return _PARAM_NAMES.get(found.group(1), found.group(1))
    return None
