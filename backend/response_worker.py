"""A thread that performs every call into Triton's response path (send, metrics).

Sends and metric updates are IPC round trips to the server process; doing them here
means a slow gRPC client or a burst of sends never delays the engine step."""
from __future__ import annotations

import queue
import threading
import traceback
from typing import Any, Callable, Mapping

import numpy as np

from backend import triton_io
from backend.metrics import NullMetrics, StepMetrics, TritonMetrics

_STOP = object()


class ResponseWorker:
    def __init__(self, metrics: TritonMetrics | NullMetrics) -> None:
        self._metrics = metrics
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="triton-response-sender", daemon=True)
        self._thread.start()

    def send(self, sender: Any, tensors: Mapping[str, np.ndarray] | None, final: bool) -> None:
        self._queue.put(lambda: _send(sender, tensors, final))

    def send_error(self, sender: Any, message: str, code: int) -> None:
        self._queue.put(lambda: triton_io.send_error(sender, message, code))

    def record(self, step: StepMetrics) -> None:
        if not step.empty():
            self._queue.put(lambda: self._metrics.record(step))

    def stop(self) -> None:
        """Sends everything queued so far, then ends the thread."""
        self._queue.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while True:
            task: Callable[[], None] | object = self._queue.get()
            if task is _STOP:
                return
            try:
                task()
            except Exception:  # noqa: BLE001 - one client's broken stream must not stop the others
                triton_io.log_error("response sender: " + traceback.format_exc())


def _send(sender: Any, tensors: Mapping[str, np.ndarray] | None, final: bool) -> None:
    flags = triton_io.FINAL if final else 0
    if tensors is None:
        sender.send(flags=flags)
    else:
        sender.send(triton_io.make_response(tensors), flags=flags)
