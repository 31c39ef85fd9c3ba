"""The engine thread: admits requests, steps the engine while there is work, routes
each request's output to its Triton response sender, and handles cancellation and
engine failures. Only this thread touches the engine after start-up.

Admission control sits in front of it: `refusal()` is asked before a request is even
parsed, and says UNAVAILABLE once MAX_QUEUE_LEN sequences wait or the loop has died;
`submit` admits a request only if all of its `n` sequences fit under MAX_QUEUE_LEN. With
REQUEST_DEADLINE_S a request still unfinished that long after its arrival is aborted (a
client that never reads holds its slots otherwise: the backend only sees cancellation). An
exception escaping the loop outside engine.step() ends the thread, but never silently:
every queued and in-flight request gets UNAVAILABLE, so does every later one, and
`on_death` lets the model report itself unhealthy.

Over 300 lines: the engine thread, its admission, deadlines and failure handling share
one lock and one set of request maps; backend/'s move (issue 48 item 3) splits it by
concern."""
from __future__ import annotations

import collections
import threading
import time
import traceback
from typing import Any, Callable

from backend import triton_io
from backend.inflight import Inflight, record_timings
from backend.metrics import StepMetrics
from backend.response_worker import ResponseWorker

UNHEALTHY = "Model is unavailable due to unhealthy vLLM engine"


class EngineLoop:
    """`make_engine` runs on the engine thread: every torch op, the model load and its
    warm-up included, must come from that one thread. libgomp keeps a worker pool per
    thread that ever ran a parallel region, and once it manages more threads than there
    are CPUs it spins only ~100 iterations before sleeping, turning every op boundary
    into a futex wake-up (measured: 51k sleeps of the OpenMP worker in a 17 s run and
    decode steps 40% slower than in-process)."""

    def __init__(self, make_engine: Callable[[], Any], worker: ResponseWorker,
                 collect_metrics: bool, max_queue_len: int = 0, fail_at_step: int = 0,
                 on_death: Callable[[str], None] | None = None,
                 request_deadline_s: float = 0.0) -> None:
        self._worker = worker
        self._collect_metrics = collect_metrics
        self._max_queue_len = max_queue_len
        self._deadline_s = request_deadline_s  # 0: none
        self._fail_at_step = fail_at_step  # test-only: raise outside step() after this step
        self._on_death = on_death
        self._cond = threading.Condition()
        # Guarded by _cond: the inbox, the counters and the stop/death state.
        self._inbox: collections.deque[Inflight] = collections.deque()
        # Sequences accepted but not running yet: every inbox request's `n` plus the
        # engine's WAITING queue (one entry a sequence) as of the last step, counted up at
        # once on submit, so a burst between two steps cannot overshoot. Counting requests
        # let 100 requests with n=16 queue 1536 sequences under MAX_QUEUE_LEN=1024.
        self._num_queued = 0
        self._num_rejected = 0  # refused as "server busy" since the last metrics record
        self._num_cancelled = 0  # engine thread only: cancelled since the last record
        self._death: str | None = None
        self._stopping = False
        self._drain_deadline = 0.0
        # Engine thread only: taken from the inbox, not yet handed to the engine (kept
        # here, not in a local, so a loop that dies mid-admission still answers them).
        self._pending: collections.deque[Inflight] = collections.deque()
        self._active: dict[str, Inflight] = {}
        # Engine thread only: this step's FINAL responses (sender, tensors, request id),
        # sent once the step's metrics are recorded, so a scrape right after a request's
        # last response counts it (vllm_backend's metrics test reads them at once).
        self._finals: list[tuple[Any, Any, str]] = []
        self._num_steps = 0
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.engine: Any = None
        self._thread = threading.Thread(target=self._run, args=(make_engine,), name="llm-engine-loop",
                                        daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    def refusal(self) -> str | None:
        """Why a new request must get UNAVAILABLE right now, or None to accept it. Cheap:
        execute asks before parsing, so an overloaded model sheds load without tokenizing."""
        with self._cond:
            closed = self._closed_reason()
            if closed is not None:
                return closed
            if self._max_queue_len and self._num_queued >= self._max_queue_len:
                self._num_rejected += 1
                return self._busy(1)
        return None

    def _busy(self, num_seqs: int) -> str:
        # Caller holds _cond.
        return (f"server busy: {self._num_queued} sequences already queued, this request needs "
                f"{num_seqs} (MAX_QUEUE_LEN={self._max_queue_len}); retry later")

    def submit(self, request: Inflight) -> None:
        """Queues the request, or answers it at once: UNAVAILABLE when the loop is closed or
        its `n` sequences do not all fit under MAX_QUEUE_LEN now, INVALID_ARG when they
        never can."""
        num_seqs = request.num_seqs
        code = triton_io.UNAVAILABLE
        with self._cond:
            reason = self._closed_reason()
            if reason is None and self._max_queue_len:
                if num_seqs > self._max_queue_len:
                    reason, code = (f"n={num_seqs} sequences exceed the queue's capacity "
                                    f"(MAX_QUEUE_LEN={self._max_queue_len})"), triton_io.INVALID_ARG
                elif self._num_queued + num_seqs > self._max_queue_len:
                    self._num_rejected += 1
                    reason = self._busy(num_seqs)
            if reason is None:
                self._inbox.append(request)
                self._num_queued += num_seqs
                self._cond.notify()
                return
        self._worker.send_error(request.sender, reason, code)

    def _closed_reason(self) -> str | None:
        # Caller holds _cond.
        # vllm_backend's text leads (its clients match it), ours follows.
        if self._death is not None:
            return f"{UNHEALTHY}: its engine stopped ({self._death})"
        if self._stopping:
            return "model is shutting down"
        if not self._thread.is_alive():
            return f"{UNHEALTHY}: its engine thread is not running"
        return None

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
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - whatever ends the loop must not end it silently
            self._die(exc)
        finally:
            self._close_engine()

    def _close_engine(self) -> None:
        # Frees what a reload of the model needs again, e.g. the KV-event ports.
        close = getattr(self.engine, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - the loop is over either way
                triton_io.log_error("closing the engine failed: " + traceback.format_exc())

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._active and not self._stopping:
                    self._cond.wait()  # idle: sleep until a request or stop arrives
                self._pending.extend(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            while self._pending:
                self._admit(self._pending[0])
                self._pending.popleft()
            if stopping:
                if not self._active:
                    return
                if time.monotonic() > self._drain_deadline:
                    self._fail(list(self._active), "model was unloaded before the request finished",
                               triton_io.UNAVAILABLE)
                    return
            self._poll_cancellations()
            if self._deadline_s:
                self._expire()
            if self._active and not self.engine.has_unfinished_requests():
                # Never spin: requests the engine no longer knows would wait forever.
                self._fail(list(self._active), "engine dropped the request without finishing it",
                           triton_io.INTERNAL)
            step = StepMetrics()
            if self._active:
                self._step(step)
                self._worker.step_done()
                self._num_steps += 1
                if self._num_steps == self._fail_at_step:
                    raise RuntimeError(f"injected engine-loop failure after step {self._num_steps} "
                                       "(INJECT_LOOP_FAILURE_AT_STEP)")
            # Also after aborts without a step, so KV usage drops to 0 on the dashboard.
            stats = self.engine.get_stats()
            with self._cond:
                self._num_queued = sum(r.num_seqs for r in self._inbox) + stats.num_waiting
                step.num_rejected, self._num_rejected = self._num_rejected, 0
            step.num_cancelled, self._num_cancelled = self._num_cancelled, 0
            if self._collect_metrics:
                step.stats = stats
                self._worker.record(step)
            self._send_finals()

    def _send_finals(self) -> None:
        finals, self._finals = self._finals, []
        for sender, tensors, request_id in finals:
            self._worker.send(sender, tensors, final=True, request_id=request_id)

    def _die(self, exc: BaseException) -> None:
        """The loop cannot go on: fail everything it holds and everything that comes later
        with UNAVAILABLE (the engine is left alone: its state is suspect)."""
        reason = f"{type(exc).__name__}: {exc}"
        self._send_finals()  # those requests finished: their answers stand
        triton_io.log_error(f"engine loop died; failing {len(self._active)} in-flight and all later "
                            f"requests with UNAVAILABLE: {traceback.format_exc()}")
        with self._cond:
            self._death = reason
            orphans = [r for r in self._pending if r.request_id not in self._active]
            orphans += self._inbox
            self._inbox.clear()
            message = self._closed_reason()
        self._pending.clear()
        for request in orphans:
            self._worker.send_error(request.sender, message, triton_io.UNAVAILABLE)
        for request_id in list(self._active):
            request = self._retire(request_id)
            self._worker.send_error(request.sender, message, triton_io.UNAVAILABLE, request_id)
        if self._on_death is not None:
            try:
                self._on_death(reason)
            except Exception:  # noqa: BLE001 - the requests are answered; only log this
                triton_io.log_error("engine loop on_death: " + traceback.format_exc())

    def _admit(self, request: Inflight) -> None:
        try:
            # Triton's arrival: the engine's queue time then counts the inbox too.
            self.engine.add_request(request.request_id, request.prompt, request.params,
                                    priority=request.priority, arrival_time=request.arrival,
                                    lora_request=request.lora_request, tenant=request.tenant)
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

    def _expire(self) -> None:
        # Arrival is Triton's (time.monotonic() in execute): the deadline covers the queue.
        limit = time.monotonic() - self._deadline_s
        expired = [rid for rid, r in self._active.items() if r.arrival < limit]
        if not expired:
            return
        self.engine.abort_request(expired)
        self._num_cancelled += len(expired)  # finished_reason=abort, as a cancellation
        for request_id in expired:
            request = self._retire(request_id)
            self._worker.send_error(
                request.sender, f"Request was cancelled: it ran past its deadline "
                f"(REQUEST_DEADLINE_S={self._deadline_s:g})", triton_io.CANCELLED, request_id)

    def _poll_cancellations(self) -> None:
        # The worker thread does the is_cancelled() round trips; here only the result.
        cancelled = [r for r in self._worker.take_cancelled() if r in self._active]
        if not cancelled:
            return
        # vllm_backend's log lines around an abort (its CI tests look for them).
        triton_io.log_info(f"[vllm] Cancelling the request ({', '.join(cancelled)})")
        self.engine.abort_request(cancelled)
        triton_io.log_info("[vllm] Successfully cancelled the request")
        self._num_cancelled += len(cancelled)  # vLLM's request_success{finished_reason=abort}
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
            code = triton_io.INVALID_ARG if getattr(exc, "bad_request", False) else triton_io.INTERNAL
            self._fail(failed, f"engine step failed: {exc}", code)
            if getattr(exc, "fatal", False):
                raise  # no step can succeed again: the loop dies (and the health check unloads)
            return
        now = time.monotonic()
        # A stand-in engine may not count its steps' tokens.
        num_tokens = getattr(self.engine, "last_step_num_tokens", 0)
        if num_tokens:
            step.iteration_tokens.append(num_tokens)
        for out in outputs:
            request = self._active.get(out.request_id)
            if request is None:
                continue  # aborted meanwhile
            record_timings(request, out, step, now)
            try:
                tensors = request.build(out)
            except Exception as exc:  # noqa: BLE001
                triton_io.log_error(f"building response for {out.request_id}: {traceback.format_exc()}")
                self.engine.abort_request([out.request_id])
                self._retire(out.request_id)
                self._worker.send_error(request.sender, f"response building failed: {exc}",
                                        triton_io.INTERNAL, out.request_id)
                continue
            if out.finished:
                self._finals.append((request.sender, tensors, out.request_id))
            elif tensors is not None:
                self._worker.send(request.sender, tensors, final=False, request_id=out.request_id)
            if out.finished:
                self._retire(out.request_id)
