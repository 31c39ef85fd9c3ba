"""config.pbtxt `parameters` -> (EngineConfig, backend options). Pure Python.

Everything not listed in BackendOptions is an engine argument, so a misspelt engine
argument fails the model load instead of being silently ignored."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from backend.request_parsing import InvalidRequest, to_bool
from engine.config import EngineConfig


@dataclass(slots=True)
class BackendOptions:
    report_custom_metrics: bool = False
    # finalize lets in-flight requests finish for this long before cancelling them.
    drain_timeout_s: float = 10.0


_BACKEND_KEYS = {"REPORT_CUSTOM_METRICS": "report_custom_metrics",
                 "DRAIN_TIMEOUT_S": "drain_timeout_s"}


def split_parameters(params: Mapping[str, str]) -> tuple[EngineConfig, BackendOptions]:
    """Raises ValueError naming the offending parameter."""
    engine_args: dict[str, str] = {}
    options = BackendOptions()
    for key, value in params.items():
        if key in _BACKEND_KEYS:
            attr = _BACKEND_KEYS[key]
            try:
                if attr == "report_custom_metrics":
                    options.report_custom_metrics = to_bool(key, value)
                else:
                    options.drain_timeout_s = float(value)
            except (InvalidRequest, ValueError):
                raise ValueError(f"parameter {key!r}: invalid value {value!r}") from None
        else:
            engine_args[key] = value
    try:
        config = EngineConfig.from_dict(engine_args)
    except ValueError as exc:
        raise ValueError(f"invalid engine parameter in config.pbtxt: {exc}") from None
    return config, options
