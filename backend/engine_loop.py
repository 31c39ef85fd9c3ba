"""The engine thread: admits requests, steps the engine while there is work, routes
each request's output to its Triton response sender, and handles cancellation and
engine failures. Only this thread touches the engine after start-up."""
from __future__ import annotations

import collections
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from backend import triton_io
from backend.metrics import StepMetrics
from backend.response_worker import ResponseWorker
from engine.request import RequestOutput, SamplingParams


@dataclass(slots=True)
class Inflight:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sender: Any
    # RequestOutput -> tensors to send, or None when this step has nothing for the client.
    build: Callable[[RequestOutput], dict[str, np.ndarray] | None]
    arrival: float
    first_token_at: float | None = None
    last_token_at: float | None = None


class EngineLoop:
    """`make_engine` runs on the engine thread: every torch op, the model load and its
    warm-up included, must come from that one thread. libgomp keeps a worker pool per
    thread that ever ran a parallel region, and once it manages more threads than there
    are CPUs it spins only ~100 iterations before sleeping, turning every op boundary
    into a futex wake-up (measured: 51k sleeps of the OpenMP worker in a 17 s run and
    decode steps 40% slower than in-process)."""

    def __init__(self, make_engine: Callable[[], Any], worker: ResponseWorker,
                 collect_metrics: bool) -> None:
        self._worker = worker
        self._collect_metrics = collect_metrics
        self._cond = threading.Condition()
        self._inbox: collections.deque[Inflight] = collections.deque()
        self._active: dict[str, Inflight] = {}
        self._stopping = False
        self._drain_deadline = 0.0
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.engine: Any = None
        self._thread = threading.Thread(target=self._run, args=(make_engine,), name="llm-engine-loop",
                                        daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    def submit(self, request: Inflight) -> None:
        with self._cond:
            if self._stopping:
                self._worker.send_error(request.sender, "model is shutting down", triton_io.UNAVAILABLE)
                return
            self._inbox.append(request)
            self._cond.notify()

    def stop(self, drain_timeout_s: float) -> None:
        """Lets in-flight requests finish for up to drain_timeout_s, then cancels the rest."""
        with self._cond:
            self._stopping = True
            self._drain_deadline = time.monotonic() + drain_timeout_s
            self._cond.notify()
        self._thread.join()

    def _run(self, make_engine: Callable[[], Any]) -> None:
        try:
            self.engine = make_engine()
        except BaseException as exc:  # noqa: BLE001 - re-raised by __init__ on the loading thread
            self._build_error = exc
            return
        finally:
            self._built.set()
        while True:
            with self._cond:
                while not self._inbox and not self._active and not self._stopping:
                    self._cond.wait()  # idle: sleep until a request or stop arrives
                new = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            for request in new:
                self._admit(request)
            if stopping:
                if not self._active:
                    return
                if time.monotonic() > self._drain_deadline:
                    self._fail(list(self._active), "model was unloaded before the request finished",
                               triton_io.UNAVAILABLE)
                    return
            self._poll_cancellations()
            if self._active and not self.engine.has_unfinished_requests():
                # Never spin: requests the engine no longer knows would wait forever.
                self._fail(list(self._active), "engine dropped the request without finishing it",
                           triton_io.INTERNAL)
            step = StepMetrics()
            if self._active:
                self._step(step)
                self._worker.step_done()
            if self._collect_metrics:
                # Also after aborts without a step, so KV usage drops to 0 on the dashboard.
                step.stats = self.engine.get_stats()
                self._worker.record(step)

    def _admit(self, request: Inflight) -> None:
        try:
            self.engine.add_request(request.request_id, request.prompt, request.params)
        except ValueError as exc:
            self._worker.send_error(request.sender, str(exc), triton_io.INVALID_ARG)
            return
        except Exception as exc:  # noqa: BLE001
            triton_io.log_error(f"add_request {request.request_id}: {traceback.format_exc()}")
            self._worker.send_error(request.sender, f"engine rejected the request: {exc}",
                                    triton_io.INTERNAL)
            return
        self._active[request.request_id] = request
        self._worker.watch(request.request_id, request.sender)

    def _retire(self, request_id: str) -> Inflight | None:
        request = self._active.pop(request_id, None)
        if request is not None:
            self._worker.unwatch(request_id)
        return request

    def _poll_cancellations(self) -> None:
        # The worker thread does the is_cancelled() round trips; here only the result.
        cancelled = [r for r in self._worker.take_cancelled() if r in self._active]
        if not cancelled:
            return
        self.engine.abort_request(cancelled)
        for request_id in cancelled:
            request = self._retire(request_id)
            self._worker.send_error(request.sender, "Request was cancelled", triton_io.CANCELLED,
                                    request_id)

    def _fail(self, request_ids: list[str], message: str, code: int) -> None:
        try:
            self.engine.abort_request(request_ids)
        except Exception:  # noqa: BLE001 - the requests are failed either way
            triton_io.log_error("abort after failure: " + traceback.format_exc())
        for request_id in request_ids:
            request = self._retire(request_id)
            if request is not None:
                self._worker.send_error(request.sender, message, code, request_id)

    def _step(self, step: StepMetrics) -> None:
        step_start = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001
            # The engine names the requests its failed step was computing (and has
            # aborted them); only those are lost, waiting requests carry on. Without
            # that list every in-flight request is failed and aborted.
            failed = getattr(exc, "failed_request_ids", None)
            failed = list(self._active) if failed is None else [r for r in failed if r in self._active]
            triton_io.log_error(f"engine step failed; failing {len(failed)} in-flight "
                                f"request(s): {traceback.format_exc()}")
            self._fail(failed, f"engine step failed: {exc}", triton_io.INTERNAL)
            return
        now = time.monotonic()
        for out in outputs:
            request = self._active.get(out.request_id)
            if request is None:
                continue  # aborted meanwhile
            self._account(request, out, step, step_start, now)
            try:
                tensors = request.build(out)
            except Exception as exc:  # noqa: BLE001
                triton_io.log_error(f"building response for {out.request_id}: {traceback.format_exc()}")
                self.engine.abort_request([out.request_id])
                self._retire(out.request_id)
                self._worker.send_error(request.sender, f"response building failed: {exc}",
                                        triton_io.INTERNAL, out.request_id)
                continue
            if tensors is not None or out.finished:
                self._worker.send(request.sender, tensors, final=out.finished,
                                  request_id=out.request_id)
            if out.finished:
                self._retire(out.request_id)

    @staticmethod
    def _account(request: Inflight, out: RequestOutput, step: StepMetrics, step_start: float,
                 now: float) -> None:
        new_tokens = len(out.outputs[0].delta_token_ids)
        if new_tokens:
            if request.first_token_at is None:
                request.first_token_at = now
                step.ttft.append(now - request.arrival)
                queued = (out.metrics or {}).get("queue_time")
                # Without the engine's own figure: arrival until the step that ran the
                # (last chunk of the) prefill began.
                step.queue.append(queued if queued is not None else max(0.0, step_start - request.arrival))
            else:
                step.itl.append(now - request.last_token_at)
            request.last_token_at = now
        if out.finished:
            step.e2e.append(now - request.arrival)
