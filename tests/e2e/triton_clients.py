"""Small tritonclient helpers for the e2e tests: one request per gRPC stream when
errors must be attributed (stream errors carry no request id), many requests on one
stream otherwise."""
from __future__ import annotations

import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import requests
import tritonclient.grpc as grpcclient

_DTYPES = {np.dtype(np.object_): "BYTES", np.dtype(np.bool_): "BOOL", np.dtype(np.int32): "INT32",
           np.dtype(np.uint64): "UINT64", np.dtype(np.float32): "FP32", np.dtype(np.uint32): "UINT32"}


@dataclass
class Outcome:
    responses: list[dict[str, np.ndarray]] = field(default_factory=list)
    error: str | None = None
    final: bool = False

    def texts(self, name: str = "text_output") -> list[str]:
        return [r[name].reshape(-1)[0].decode("utf-8") for r in self.responses if name in r]

    @property
    def text(self) -> str:
        return "".join(self.texts())


def tensors_to_inputs(tensors: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in tensors.items():
        inp = grpcclient.InferInput(name, list(array.shape), _DTYPES[array.dtype])
        inp.set_data_from_numpy(array)
        inputs.append(inp)
    return inputs


def llm_inputs(prompt: str, sampling: dict[str, Any] | None = None, stream: bool = False,
               exclude_input_in_output: bool | None = None, **flags: bool) -> dict[str, np.ndarray]:
    import json

    tensors = {"text_input": np.array([prompt.encode()], dtype=np.object_),
               "stream": np.array([stream], dtype=np.bool_)}
    if sampling is not None:
        tensors["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=np.object_)
    if exclude_input_in_output is not None:
        tensors["exclude_input_in_output"] = np.array([exclude_input_in_output], dtype=np.bool_)
    for name, value in flags.items():
        tensors[name] = np.array([value], dtype=np.bool_)
    return tensors


def ensemble_inputs(prompt: str, max_tokens: int, stream: bool = False, **extra: Any) -> dict[str, np.ndarray]:
    tensors = {"text_input": np.array([[prompt.encode()]], dtype=np.object_),
               "max_tokens": np.array([[max_tokens]], dtype=np.int32),
               "stream": np.array([[stream]], dtype=np.bool_)}
    for name, value in extra.items():
        tensors[name] = np.asarray(value).reshape(1, -1) if not isinstance(value, np.ndarray) else value
    return tensors


def _collect(result: Any) -> tuple[dict[str, np.ndarray], bool]:
    response = result.get_response()
    outputs = {out.name: result.as_numpy(out.name) for out in response.outputs}
    final = response.parameters["triton_final_response"].bool_param
    return outputs, final


def infer_many(url: str, model: str, requests_: list[dict[str, np.ndarray]], timeout: float = 300.0
               ) -> list[Outcome]:
    """All requests on one stream; fails the test if any request errors."""
    outcomes = [Outcome() for _ in requests_]
    done = threading.Semaphore(0)
    errors: list[str] = []

    def callback(result: Any, error: Any) -> None:
        if error is not None:
            errors.append(str(error))
            done.release()
            return
        outputs, final = _collect(result)
        index = int(result.get_response().id)
        if outputs:
            outcomes[index].responses.append(outputs)
        if final:
            outcomes[index].final = True
            done.release()

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    try:
        for i, tensors in enumerate(requests_):
            client.async_stream_infer(model, tensors_to_inputs(tensors), request_id=str(i),
                                      enable_empty_final_response=True)
        for _ in requests_:
            if not done.acquire(timeout=timeout):
                raise TimeoutError(f"{model}: not all requests finished in {timeout} s")
    finally:
        client.stop_stream()
        client.close()
    assert not errors, errors
    return outcomes


def infer_one(url: str, model: str, tensors: dict[str, np.ndarray], timeout: float = 120.0) -> Outcome:
    """One request on its own stream, errors captured in the Outcome."""
    outcome = Outcome()
    finished: queue.SimpleQueue = queue.SimpleQueue()

    def callback(result: Any, error: Any) -> None:
        if error is not None:
            outcome.error = str(error)
            outcome.final = True
            finished.put(True)
            return
        outputs, final = _collect(result)
        if outputs:
            outcome.responses.append(outputs)
        if final:
            outcome.final = True
            finished.put(True)

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer(model, tensors_to_inputs(tensors), request_id="0",
                                  enable_empty_final_response=True)
        finished.get(timeout=timeout)
    finally:
        client.stop_stream()
        client.close()
    return outcome


class OpenStream:
    """One request on its own stream, opened ahead so that several requests can be sent
    within a millisecond of each other; arrival times are kept for ordering checks."""

    def __init__(self, url: str) -> None:
        self.outcome = Outcome()
        self.sent_at = self.first_response_at = self.last_response_at = self.ended_at = 0.0
        self._ended = threading.Event()
        self._client = grpcclient.InferenceServerClient(url)
        self._client.start_stream(callback=self._callback)

    def _callback(self, result: Any, error: Any) -> None:
        now = time.monotonic()
        if error is not None:
            self.outcome.error = str(error)
        else:
            outputs, final = _collect(result)
            if outputs:
                self.outcome.responses.append(outputs)
                self.first_response_at = self.first_response_at or now
                self.last_response_at = now
            if not final:
                return
        self.outcome.final = True
        self.ended_at = now
        self._ended.set()

    def send(self, model: str, tensors: dict[str, np.ndarray]) -> None:
        self.sent_at = time.monotonic()
        self._client.async_stream_infer(model, tensors_to_inputs(tensors), request_id="0",
                                        enable_empty_final_response=True)

    def wait(self, timeout: float) -> bool:
        """True once the request ended (final response or error) within `timeout`."""
        ended = self._ended.wait(timeout)
        self._client.stop_stream(cancel_requests=not ended)
        self._client.close()
        return ended


def scrape_metrics(metrics_url: str, prefix: str = "vllm:") -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for the metrics named `prefix`..."""
    values = {}
    for line in requests.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith(prefix):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


_SERIES = re.compile(r'(?P<name>[^{]+)\{(?P<labels>[^}]*)\}$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def series_labels(key: str) -> tuple[str, dict[str, str]]:
    match = _SERIES.match(key)
    assert match, f"not a labelled series: {key}"
    return match.group("name"), dict(_LABEL.findall(match.group("labels")))


def metric_by_instance(values: dict[str, float], name: str, model: str) -> dict[str, float]:
    """One value per model instance (the `engine` label, vLLM's data-parallel rank) of a
    model's series, summed over any other label."""
    out = {}
    for key, value in values.items():
        series, labels = series_labels(key)
        if series == name and labels.get("model") == model and labels.get("version") == "1":
            engine = labels.get("engine", "")
            out[engine] = out.get(engine, 0.0) + value
    return out


def metric(values: dict[str, float], name: str, model: str) -> float:
    """A model's value: summed over its instances (one series each)."""
    per_instance = metric_by_instance(values, name, model)
    assert per_instance, f"{name} for {model} not exported"
    return sum(per_instance.values())
