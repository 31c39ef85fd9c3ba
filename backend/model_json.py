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
from typing import Any, Callable

from backend import vllm_engine_args as vllm
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.values import to_bool, to_float, to_int

FILE_NAME = "model.json"
_OWN_NAMES = frozenset(f.name for cls in (EngineConfig, SchedulerConfig, CacheConfig)
                       for f in dataclasses.fields(cls)) - {"scheduler", "cache"}


@dataclass(slots=True)
class ModelJson:
    """model.json as this engine's arguments; config.pbtxt parameters go on top."""
    # This engine's argument names (EngineConfig.from_dict) -> model.json values.
    engine_args: dict[str, Any] = field(default_factory=dict)
    gpu_memory_utilization: float | None = None
    disable_log_stats: bool = False
    stream_interval: int | None = None
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
        elif key == vllm.GPU_MEMORY_UTILIZATION:
            out.gpu_memory_utilization = _utilization(value)
        elif key == vllm.DISABLE_LOG_STATS:
            out.disable_log_stats = value is not None and to_bool(_named(key), value)
        elif key == vllm.STREAM_INTERVAL:
            out.stream_interval = None if value is None else _stream_interval(value)
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


def _utilization(value: Any) -> float:
    share = to_float(_named(vllm.GPU_MEMORY_UTILIZATION), value)
    if not 0.0 < share <= 1.0:
        raise ValueError(f"{_named(vllm.GPU_MEMORY_UTILIZATION)} must be in (0, 1], got {share}")
    return share


def _stream_interval(value: Any) -> int:
    interval = to_int(_named(vllm.STREAM_INTERVAL), value)
    if interval < 1:
        raise ValueError(f"{_named(vllm.STREAM_INTERVAL)} must be >= 1, got {interval}")
    return interval


def _named(key: str) -> str:
    return f"{FILE_NAME} key {key!r}"


def _same(value: Any, allowed: Any) -> bool:
    # 1 == True in Python; in a config file they are different things.
    return value == allowed and isinstance(value, bool) == isinstance(allowed, bool)


def _suggestion(key: str) -> str:
    known = [*vllm.RENAMED, *_OWN_NAMES, vllm.GPU_MEMORY_UTILIZATION, vllm.DISABLE_LOG_STATS,
             *vllm.NO_EFFECT, *vllm.UNSUPPORTED]
    close = difflib.get_close_matches(key, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def cuda_total_memory(device: str) -> int:
    import torch

    return torch.cuda.get_device_properties(torch.device(device)).total_memory


def apply_gpu_memory_utilization(config: EngineConfig, share: float, explicit_pool: bool,
                                 total_memory: Callable[[str], int] = cuda_total_memory
                                 ) -> tuple[EngineConfig, str]:
    """The KV pool takes `share` of the GPU's memory. vLLM's share also covers the
    weights and activations; here it is the pool's alone, so leave room for them. On a
    CPU it is ignored, as vLLM's CPU backend ignores it: the pool is
    kv_cache_memory_bytes. An explicit pool size (kv_cache_memory_bytes or
    num_kv_blocks, from either file) wins, as kv_cache_memory_bytes does in vLLM.
    Returns the config and a line for the load log."""
    name = _named(vllm.GPU_MEMORY_UTILIZATION)
    if explicit_pool:
        return config, f"{name} ignored: the KV pool's size is given explicitly"
    device = config.torch_device
    if not device.startswith("cuda"):
        return config, (f"{name} ignored on {device}, as vLLM's CPU backend does: the KV pool "
                        f"is kv_cache_memory_bytes ({config.cache.kv_cache_memory_bytes} bytes)")
    pool = int(share * total_memory(device))
    cache = dataclasses.replace(config.cache, kv_cache_memory_bytes=pool)
    return (dataclasses.replace(config, cache=cache),
            f"{name} = {share}: KV pool of {pool} bytes on {device}")
