"""The only module that touches triton_python_backend_utils: reading request inputs,
building responses and errors, reading config.pbtxt parameters.

Everything above it deals in numpy arrays and plain dicts."""
from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

import numpy as np
import triton_python_backend_utils as pb_utils

_ERROR_CODES = ("INVALID_ARG", "CANCELLED", "INTERNAL", "UNAVAILABLE")


def __getattr__(name: str) -> Any:
    # The stub attaches TritonError and friends to pb_utils only after our module is
    # imported (auto-complete imports model.py first), so look them up on use.
    if name in _ERROR_CODES:
        return getattr(pb_utils.TritonError, name)
    if name == "FINAL":
        return pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    raise AttributeError(name)


def read_inputs(request: Any, names: Iterable[str]) -> dict[str, np.ndarray | None]:
    out: dict[str, np.ndarray | None] = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        out[name] = None if tensor is None else tensor.as_numpy()
    return out


def input_names(model_config: Mapping[str, Any]) -> list[str]:
    return [entry["name"] for entry in model_config.get("input", [])]


def model_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """config.pbtxt `parameters` as {key: string_value}."""
    return {key: value.get("string_value", "")
            for key, value in model_config.get("parameters", {}).items()}


def parse_model_config(args: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(args["model_config"])


def make_response(tensors: Mapping[str, np.ndarray]) -> Any:
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(name, array) for name, array in tensors.items()])


def make_error(message: str, code: int | None = None) -> Any:
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def send_error(sender: Any, message: str, code: int | None = None) -> None:
    sender.send(make_error(message, code), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def log_info(message: str) -> None:
    pb_utils.Logger.log_info(message)


def log_warning(message: str) -> None:
    pb_utils.Logger.log_warn(message)


def log_error(message: str) -> None:
    pb_utils.Logger.log_error(message)


def string_array(values: list[str], shape: tuple[int, ...] | None = None) -> np.ndarray:
    array = np.array([v.encode("utf-8") for v in values], dtype=np.object_)
    return array if shape is None else array.reshape(shape)


def unload_model(model_name: str) -> None:
    """Asks the server to unload a model, this one included; returns before it is done.
    Raises unless the server runs with --model-control-mode=explicit."""
    pb_utils.unload_model(model_name)
