"""model.json, vllm_backend's file of vLLM engine arguments in the model's version
folder (`<repository>/<model>/<version>/model.json`), read as vllm_backend reads it: one
JSON object of vLLM argument names. Pure Python.

Each key is one of: a vLLM argument this engine has (renamed where its name differs,
backend/vllm_engine_args.py), this engine's own argument name, a vLLM argument that
changes nothing here (accepted, logged), or a vLLM feature this engine lacks (accepted
only at the value that leaves it off). Anything else is a typo and fails the load, as
vLLM's AsyncEngineArgs(**model_json) fails on it."""
from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend import vllm_engine_args as vllm
from engine.api import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig, to_bool

FILE_NAME = "model.json"
ALLOW_RUNTIME_LORA_UPDATING = "allow_runtime_lora_updating"
_OWN_NAMES = frozenset(f.name for cls in (EngineConfig, SchedulerConfig, CacheConfig, LoRAConfig)
                       for f in dataclasses.fields(cls)) - {"scheduler", "cache", "lora"}


@dataclass(slots=True)
class ModelJson:
    """model.json as this engine's arguments; config.pbtxt parameters go on top."""
    # This engine's argument names (EngineConfig.from_dict) -> model.json values.
    engine_args: dict[str, Any] = field(default_factory=dict)
    disable_log_stats: bool = False
    # Not a vLLM engine argument (vLLM reads VLLM_ALLOW_RUNTIME_LORA_UPDATING from its
    # environment): the backend option of that name (backend/config_params.py).
    allow_runtime_lora_updating: bool = False
    # What was accepted but changes nothing, for the load log.
    ignored: list[str] = field(default_factory=list)


def read_model_json(version_dir: Path) -> ModelJson | None:
    """None when the version folder has no model.json (engine arguments then come from
    config.pbtxt alone). Raises ValueError naming the file or the offending key."""
    path = Path(version_dir) / FILE_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: not readable as JSON: {exc}") from None
    try:
        return parse_model_json(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def parse_model_json(data: Any) -> ModelJson:
    if not isinstance(data, dict):
        raise ValueError(f"{FILE_NAME} must hold a JSON object of engine arguments, "
                         f"got {type(data).__name__}")
    out = ModelJson()
    for key, value in data.items():
        if key in vllm.RENAMED or key in _OWN_NAMES:
            _take_engine_arg(out, key, value)
        elif key == vllm.DISABLE_LOG_STATS:
            out.disable_log_stats = value is not None and to_bool(_named(key), value)
        elif key == ALLOW_RUNTIME_LORA_UPDATING:
            out.allow_runtime_lora_updating = value is not None and to_bool(_named(key), value)
        elif key in vllm.NO_EFFECT:
            out.ignored.append(key)
        elif key in vllm.UNSUPPORTED:
            allowed = vllm.UNSUPPORTED[key]
            if not any(_same(value, a) for a in allowed):
                shown = " or ".join(json.dumps(a) for a in allowed)
                raise ValueError(f"vLLM engine argument {key!r} = {json.dumps(value)} is not "
                                 f"supported by this backend (only {shown})")
            out.ignored.append(key)
        else:
            raise ValueError(f"unknown engine argument {key!r}: neither a vLLM engine argument "
                             f"this backend recognises nor one of its own{_suggestion(key)}")
    return out


def _take_engine_arg(out: ModelJson, key: str, value: Any) -> None:
    if value is None:
        return  # vLLM's "not set": this engine's default stands
    name = vllm.RENAMED.get(key, key)
    if name == "dtype" and isinstance(value, str):
        value = vllm.DTYPE_ALIASES.get(value.strip().lower(), value)
    try:  # checked alone, so the error names the model.json key
        EngineConfig.from_dict({name: value})
    except ValueError as exc:
        renamed = f" ({name} here)" if name != key else ""
        raise ValueError(f"{_named(key)}{renamed}: {exc}") from None
    out.engine_args[name] = value


def _named(key: str) -> str:
    return f"{FILE_NAME} key {key!r}"


def _same(value: Any, allowed: Any) -> bool:
    # 1 == True in Python; in a config file they are different things.
    return value == allowed and isinstance(value, bool) == isinstance(allowed, bool)


def _suggestion(key: str) -> str:
    known = [*vllm.RENAMED, *_OWN_NAMES, vllm.DISABLE_LOG_STATS, ALLOW_RUNTIME_LORA_UPDATING,
             *vllm.NO_EFFECT, *vllm.UNSUPPORTED]
    close = difflib.get_close_matches(key, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
