"""config.pbtxt `parameters` and model.json -> (EngineConfig, backend options). Pure Python.

Everything in config.pbtxt not listed in BackendOptions is an engine argument, so a
misspelt engine argument fails the model load instead of being silently ignored. Engine
arguments may also come from model.json (vllm_backend's file, backend/model_json.py);
a config.pbtxt parameter wins over model.json's value for the same argument."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Mapping

from backend.model_json import ALLOW_RUNTIME_LORA_UPDATING, ModelJson
from engine.api import EngineConfig, convert


@dataclass(slots=True)
class BackendOptions:
    report_custom_metrics: bool = False
    # finalize lets in-flight requests finish for this long before cancelling them.
    drain_timeout_s: float = 10.0
    # Sequences accepted but not yet running (each request counts its `n`: the backend's
    # inbox plus the engine's WAITING queue); a request whose sequences do not all fit
    # gets UNAVAILABLE "server busy" at once. 0 = unbounded.
    max_queue_len: int = 1024
    # A request unfinished this long after it arrived is aborted (CANCELLED), freeing its
    # slots and KV blocks: Triton's ports tell the backend of a client that stopped
    # reading only if it cancels. 0 = no deadline (vllm_backend has none).
    request_deadline_s: float = 0.0
    # vllm_backend's ENABLE_VLLM_HEALTH_CHECK: once the engine thread has died the model
    # asks Triton to unload it (needs --model-control-mode=explicit), so /ready says no.
    enable_health_check: bool = False
    # With enable_lora, instead of multi_lora.json: vLLM's `name=path` entries, spaces apart.
    lora_modules: str = ""
    # With enable_lora, requests may name an adapter folder (lora_path) beside lora_name
    # (backend/lora_catalog.py); off: clients cannot make the server read arbitrary paths.
    allow_runtime_lora_updating: bool = False
    # The most (prompt token, logprob) entries one request's prompt_logprobs output may
    # hold: prompt tokens x (k + 1) x n (each sequence entry repeats it). About 83 bytes
    # of JSON an entry (measured: k=20 over a 49k vocabulary, 5-character tokens), so the
    # default bounds that output near 80 MB; a request over it is refused before it is
    # queued (a 32k-token prompt at k=20 would otherwise send some 57 MB per sequence
    # entry). 0: no cap.
    max_prompt_logprobs_entries: int = 1_000_000


# config.pbtxt key -> BackendOptions field; every number among them must be >= 0.
# (stream_interval is an engine argument, SchedulerConfig's, so it reaches every model.)
_BACKEND_KEYS = {
    "REPORT_CUSTOM_METRICS": "report_custom_metrics",
    "DRAIN_TIMEOUT_S": "drain_timeout_s",
    "MAX_QUEUE_LEN": "max_queue_len",
    "REQUEST_DEADLINE_S": "request_deadline_s",
    "ENABLE_VLLM_HEALTH_CHECK": "enable_health_check",
    "lora_modules": "lora_modules",
    ALLOW_RUNTIME_LORA_UPDATING: "allow_runtime_lora_updating",
    "MAX_PROMPT_LOGPROBS_ENTRIES": "max_prompt_logprobs_entries",
}
_OPTION_KINDS = {f.name: str(f.type) for f in fields(BackendOptions)}


def split_parameters(params: Mapping[str, str], model_json: ModelJson | None = None,
                     log: Callable[[str], None] = lambda _: None
                     ) -> tuple[EngineConfig, BackendOptions]:
    """Raises ValueError naming the offending parameter. `log` gets a line for what
    model.json set that changes nothing here."""
    engine_args: dict[str, str] = {}
    options = BackendOptions()
    for key, value in params.items():
        if key not in _BACKEND_KEYS:
            engine_args[key] = value
            continue
        attr = _BACKEND_KEYS[key]
        name = f"parameter {key!r}"
        option = convert(name, value, _OPTION_KINDS[attr])
        if isinstance(option, (int, float)) and not isinstance(option, bool) and option < 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
        setattr(options, attr, option)
    if model_json is None:
        model_json = ModelJson()
    merged = {**model_json.engine_args, **engine_args}
    try:
        config = EngineConfig.from_dict(merged)
    except ValueError as exc:
        where = "config.pbtxt" if not model_json.engine_args else "config.pbtxt / model.json"
        raise ValueError(f"invalid engine parameter in {where}: {exc}") from None
    if model_json.ignored:
        log(f"model.json: accepted and ignored (no effect in this engine): "
            f"{', '.join(model_json.ignored)}")
    if ALLOW_RUNTIME_LORA_UPDATING not in params:
        options.allow_runtime_lora_updating = model_json.allow_runtime_lora_updating
    if options.allow_runtime_lora_updating and not config.lora.enable_lora:
        raise ValueError(f"{ALLOW_RUNTIME_LORA_UPDATING} needs enable_lora=true")
    # As in vllm_backend: REPORT_CUSTOM_METRICS and not disable_log_stats.
    options.report_custom_metrics = options.report_custom_metrics and not model_json.disable_log_stats
    return config, options
