"""Loading a served model again with new engine arguments, through Triton's model
repository API (tritonserver --model-control-mode=explicit): a load with a `config`
override. Triton keeps the running instance serving until the new one is ready, then
sends new requests to the new one; requests already in the old one finish there (within
the backend's DRAIN_TIMEOUT_S) before it unloads. tritonserver is not restarted.

The config a change replaces is saved first (JSON), so that `--rollback` can load it
again through the same API."""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any


def parameters(config: dict[str, Any]) -> dict[str, str]:
    """A model config's `parameters`, as the strings config.pbtxt holds."""
    return {key: value.get("string_value", "")
            for key, value in config.get("parameters", {}).items()}


def with_parameters(config: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A copy of `config` with these parameters set (added or replaced)."""
    changed = copy.deepcopy(config)
    params = changed.setdefault("parameters", {})
    for key, value in values.items():
        params[key] = {"string_value": as_parameter(value)}
    return changed


def as_parameter(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def changed_arguments(running: dict[str, Any], wanted: dict[str, Any]) -> dict[str, str]:
    """The engine arguments in `wanted` whose value differs from the running one."""
    return {key: as_parameter(value) for key, value in wanted.items()
            if key not in running or as_parameter(running[key]) != as_parameter(value)}


def save_previous(path: Path, model: str, config: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"model": model, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "config": config}
    path.write_text(json.dumps(record, indent=1), encoding="utf-8")


def load_previous(path: Path, model: str) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(f"no saved config at {path}: nothing was applied from here, "
                                "or --saved-config names another file")
    record = json.loads(path.read_text(encoding="utf-8"))
    if record.get("model") != model:
        raise ValueError(f"{path} holds the config of model {record.get('model')!r}, "
                         f"not {model!r}")
    return record["config"]


class Repository:
    """The model repository and model-config endpoints of one server (HTTP)."""

    def __init__(self, url: str) -> None:
        import tritonclient.http as httpclient

        self.url = url.removeprefix("http://").removeprefix("https://").rstrip("/")
        self.client = httpclient.InferenceServerClient(self.url, network_timeout=900.0,
                                                       connection_timeout=900.0)

    def close(self) -> None:
        self.client.close()  # an open connection holds up tritonserver's exit

    def __enter__(self) -> "Repository":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def config(self, model: str) -> dict[str, Any]:
        return self.client.get_model_config(model)

    def reload(self, model: str, config: dict[str, Any]) -> None:
        """Returns once the new instance serves. A load that fails raises with Triton's
        error; the running instance then stays (Triton keeps a loaded version until its
        replacement is ready)."""
        self.client.load_model(model, config=json.dumps(config))
        if not self.client.is_model_ready(model):
            raise RuntimeError(f"model {model!r} is not ready after the load")
