"""config.pbtxt `parameters` -> (EngineConfig, backend options). Pure Python.

Everything not listed in BackendOptions is an engine argument, so a misspelt engine
argument fails the model load instead of being silently ignored."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from backend.request_parsing import InvalidRequest, to_bool
from engine.config import EngineConfig


@dataclass(slots=True)
class BackendOptions:
    report_custom_metrics: bool = False
    # finalize lets in-flight requests finish for this long before cancelling them.
    drain_timeout_s: float = 10.0
    # Requests accepted but not yet running (the backend's inbox plus the engine's
    # WAITING queue); one more gets UNAVAILABLE "server busy" at once. 0 = unbounded.
    max_queue_len: int = 1024
    # vllm_backend's ENABLE_VLLM_HEALTH_CHECK: once the engine thread has died the model
    # asks Triton to unload it (needs --model-control-mode=explicit), so /ready says no.
    enable_health_check: bool = False
    # Test-only: the engine loop raises outside engine.step() after this many steps.
    inject_loop_failure_at_step: int = 0


def _non_negative_int(key: str, value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError
    return number


def _non_negative_float(key: str, value: str) -> float:
    number = float(value)
    if not number >= 0:  # also refuses nan
        raise ValueError
    return number


_BACKEND_KEYS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "REPORT_CUSTOM_METRICS": ("report_custom_metrics", to_bool),
    "DRAIN_TIMEOUT_S": ("drain_timeout_s", _non_negative_float),
    "MAX_QUEUE_LEN": ("max_queue_len", _non_negative_int),
    "ENABLE_VLLM_HEALTH_CHECK": ("enable_health_check", to_bool),
    "INJECT_LOOP_FAILURE_AT_STEP": ("inject_loop_failure_at_step", _non_negative_int),
}


def split_parameters(params: Mapping[str, str]) -> tuple[EngineConfig, BackendOptions]:
    """Raises ValueError naming the offending parameter."""
    engine_args: dict[str, str] = {}
    options = BackendOptions()
    for key, value in params.items():
        if key not in _BACKEND_KEYS:
            engine_args[key] = value
            continue
        attr, convert = _BACKEND_KEYS[key]
        try:
            setattr(options, attr, convert(key, value.strip()))
        except (InvalidRequest, ValueError):
            raise ValueError(f"parameter {key!r}: invalid value {value!r}") from None
    try:
        config = EngineConfig.from_dict(engine_args)
    except ValueError as exc:
        raise ValueError(f"invalid engine parameter in config.pbtxt: {exc}") from None
    return config, options
