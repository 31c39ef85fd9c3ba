"""backend.engine_loop and backend.response_worker without a server: a stand-in for
triton_python_backend_utils, a scripted engine and recording response senders."""
from __future__ import annotations

import sys
import threading
import time
import types
from dataclasses import dataclass

import numpy as np
import pytest

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


def _fake_pb_utils() -> types.ModuleType:
    """Just what backend.triton_io reaches for outside model loading."""
    pb = types.ModuleType("triton_python_backend_utils")

    class TritonError:
        INVALID_ARG, CANCELLED, INTERNAL, UNAVAILABLE = "INVALID_ARG", "CANCELLED", "INTERNAL", "UNAVAILABLE"

        def __init__(self, message: str, code: str = "INTERNAL") -> None:
            self.message, self.code = message, code

    @dataclass
    class InferenceResponse:
        output_tensors: list
        error: TritonError | None = None

    @dataclass
    class Tensor:
        name: str
        array: np.ndarray

    pb.TritonError, pb.InferenceResponse, pb.Tensor = TritonError, InferenceResponse, Tensor
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.Logger = types.SimpleNamespace(log_info=lambda m: None, log_warn=lambda m: None,
                                      log_error=lambda m: None)
    pb.unloaded = []
    pb.unload_model = pb.unloaded.append
    return pb


sys.modules.setdefault("triton_python_backend_utils", _fake_pb_utils())

from backend import response_worker  # noqa: E402 - after the stand-in module
from backend.engine_loop import EngineLoop  # noqa: E402
from backend.inflight import Inflight  # noqa: E402
from backend.metrics import NullMetrics  # noqa: E402
from backend.response_worker import ResponseWorker  # noqa: E402


class Sender:
    def __init__(self) -> None:
        self.responses: list = []
        self.final = threading.Event()
        self.cancelled = False
        self.polls = 0

    def send(self, response=None, flags: int = 0) -> None:
        self.responses.append(response)
        if flags:
            self.final.set()

    def is_cancelled(self) -> bool:
        self.polls += 1
        return self.cancelled

    @property
    def error(self):
        last = self.responses[-1] if self.responses else None
        return None if last is None or last.error is None else last.error


class ScriptedEngine:
    """Runs up to `max_running` requests; each step gives each one token, and a request
    finishes after max_tokens. `gate` holds step() so tests can fill the queue
    deterministically; `fail_stats` makes get_stats() raise (an error outside step)."""

    def __init__(self, max_running: int = 2) -> None:
        self.max_running = max_running
        self.waiting: list[str] = []
        self.running: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.fail_stats = False

    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None,
                    lora_request=None, tenant=None) -> None:
        if not prompt:
            raise ValueError("prompt is empty")
        self.waiting.append(request_id)
        self.max_tokens[request_id] = params.max_tokens

    def abort_request(self, request_ids) -> list:
        for rid in request_ids:
            self.running.pop(rid, None)
            if rid in self.waiting:
                self.waiting.remove(rid)
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        self.gate.wait()
        while self.waiting and len(self.running) < self.max_running:
            self.running[self.waiting.pop(0)] = []
        outputs = []
        for rid, tokens in list(self.running.items()):
            tokens.append(7)
            done = len(tokens) >= self.max_tokens[rid]
            if done:
                del self.running[rid]
            outputs.append(RequestOutput(rid, None, [1], [CompletionOutput(
                0, "x" * len(tokens), list(tokens), finish_reason="length" if done else None,
                delta_token_ids=[7])], done))
        return outputs

    def get_stats(self):
        if self.fail_stats:
            raise RuntimeError("stats broke")
        return types.SimpleNamespace(num_waiting=len(self.waiting))


def inflight(request_id: str, sender: Sender, max_tokens: int = 3) -> Inflight:
    def build(out: RequestOutput):
        return {"n": np.array([len(out.outputs[0].token_ids)])} if out.finished else None
    return Inflight(request_id, [1, 2], SamplingParams(max_tokens=max_tokens), sender, build,
                    time.monotonic())


@pytest.fixture
def make_loop():
    made = []

    def make(engine: ScriptedEngine, metrics=None, **kwargs) -> EngineLoop:
        worker = ResponseWorker(metrics or NullMetrics())
        loop = EngineLoop(lambda: engine, worker, collect_metrics=metrics is not None, **kwargs)
        made.append((loop, worker, engine))
        return loop

    yield make
    for loop, worker, engine in made:
        engine.gate.set()
        loop.stop(0.0)
        worker.stop()


def wait_all(senders: list[Sender], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    for sender in senders:
        assert sender.final.wait(max(0.0, deadline - time.monotonic())), "no FINAL response"


def test_queue_bound_refuses_at_once_and_accepts_again_once_drained(make_loop):
    engine = ScriptedEngine(max_running=1)
    engine.gate.clear()  # the first step blocks: nothing leaves the queue meanwhile
    loop = make_loop(engine, max_queue_len=3)
    senders = [Sender() for _ in range(3)]
    for i, sender in enumerate(senders):
        assert loop.refusal() is None
        loop.submit(inflight(f"r{i}", sender))
    refusal = loop.refusal()
    assert refusal is not None and "server busy" in refusal and "MAX_QUEUE_LEN=3" in refusal
    engine.gate.set()
    wait_all(senders)
    assert all(s.error is None for s in senders)
    deadline = time.monotonic() + 5
    while loop.refusal() is not None:  # the count follows the engine after each step
        assert time.monotonic() < deadline, "queue count never drained"
        time.sleep(0.01)


def test_queue_counts_sequences_and_admits_a_request_only_if_all_its_n_fit(make_loop):
    """Issue 43: 100 requests with n=16 put 1536 sequences under MAX_QUEUE_LEN=1024."""
    engine = ScriptedEngine(max_running=1)
    engine.gate.clear()
    loop = make_loop(engine, max_queue_len=40)
    fits, busy, never = Sender(), Sender(), Sender()
    request = inflight("r0", fits)
    request.params = SamplingParams(max_tokens=2, n=16)
    loop.submit(request)
    loop.submit(inflight("r1", Sender()))  # 17 sequences queued
    for i in range(2):
        request = inflight(f"a{i}", Sender())
        request.params = SamplingParams(max_tokens=2, n=11)
        loop.submit(request)  # 28, then 39
    request = inflight("r2", busy)
    request.params = SamplingParams(max_tokens=2, n=2)  # 41 > 40: refused whole
    loop.submit(request)
    assert busy.final.wait(5)
    assert busy.error.code == "UNAVAILABLE"
    assert "39 sequences already queued" in busy.error.message and "MAX_QUEUE_LEN=40" in busy.error.message
    assert loop.refusal() is None  # one more single sequence still fits
    small = make_loop(ScriptedEngine(), max_queue_len=8)
    request = inflight("r3", never)
    request.params = SamplingParams(max_tokens=2, n=9)
    small.submit(request)
    assert never.final.wait(5)
    assert never.error.code == "INVALID_ARG" and "MAX_QUEUE_LEN=8" in never.error.message
    engine.gate.set()
    wait_all([fits])
    assert fits.error is None


def test_a_request_past_its_deadline_is_aborted_and_its_slot_freed(make_loop):
    engine = ScriptedEngine(max_running=1)
    loop = make_loop(engine, request_deadline_s=0.3)
    stuck, later = Sender(), Sender()
    loop.submit(inflight("stuck", stuck, max_tokens=10**9))  # a client that never reads
    assert stuck.final.wait(10)
    assert stuck.error.code == "CANCELLED" and "REQUEST_DEADLINE_S=0.3" in stuck.error.message
    assert "stuck" not in engine.running and "stuck" not in engine.waiting
    loop.submit(inflight("later", later, max_tokens=2))
    wait_all([later])
    assert later.error is None


def test_busy_refusals_are_counted_for_the_metric(make_loop):
    class Recorder:
        def __init__(self) -> None:
            self.rejected = 0

        def record(self, step) -> None:
            self.rejected += step.num_rejected

    engine, metrics, sender = ScriptedEngine(max_running=1), Recorder(), Sender()
    engine.gate.clear()
    loop = make_loop(engine, metrics=metrics, max_queue_len=1)
    loop.submit(inflight("r0", sender))
    assert loop.refusal() and loop.refusal()
    engine.gate.set()
    wait_all([sender])
    deadline = time.monotonic() + 5
    while metrics.rejected < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert metrics.rejected == 2


def test_error_outside_step_fails_everyone_and_later_requests(make_loop):
    engine = ScriptedEngine(max_running=1)
    deaths = []
    loop = make_loop(engine, on_death=deaths.append)
    engine.gate.clear()
    running = [Sender() for _ in range(3)]
    for i, sender in enumerate(running):
        loop.submit(inflight(f"r{i}", sender, max_tokens=50))
    time.sleep(0.05)
    engine.fail_stats = True  # raises right after the step the gate releases
    engine.gate.set()
    wait_all(running)
    for sender in running:
        assert sender.error.code == "UNAVAILABLE" and "stats broke" in sender.error.message
    assert deaths == ["RuntimeError: stats broke"]
    assert "engine stopped" in loop.refusal()
    late = Sender()
    loop.submit(inflight("late", late))
    wait_all([late])
    assert late.error.code == "UNAVAILABLE"


def test_injected_loop_failure_after_step(make_loop):
    engine = ScriptedEngine(max_running=4)
    loop = make_loop(engine, fail_at_step=2)
    senders = [Sender() for _ in range(2)]
    for i, sender in enumerate(senders):
        loop.submit(inflight(f"r{i}", sender, max_tokens=10))
    wait_all(senders)
    assert all(s.error.code == "UNAVAILABLE" and "INJECT_LOOP_FAILURE_AT_STEP" in s.error.message
               for s in senders)


def test_cancellation_polls_are_bounded_per_step_and_rotate(monkeypatch):
    monkeypatch.setattr(response_worker, "MIN_CANCEL_POLL_INTERVAL_S", 0.0)
    limit = response_worker.MAX_CANCEL_POLLS_PER_STEP
    worker = ResponseWorker(NullMetrics())
    senders = {f"r{i}": Sender() for i in range(3 * limit + 5)}
    senders["r7"].cancelled = True
    try:
        for rid, sender in senders.items():
            worker.watch(rid, sender)
        polls = []
        for _ in range(4):
            worker.step_done()
            polled = threading.Event()
            worker.call(polled.set)  # runs after the poll the step triggered
            assert polled.wait(5)
            polls.append(sum(s.polls for s in senders.values()))
        per_step = [b - a for a, b in zip([0] + polls, polls)]
        assert all(n <= limit for n in per_step), per_step
        # Four polls of `limit` cover all 3*limit+5 requests: every one was looked at.
        assert all(s.polls >= 1 for s in senders.values())
        assert worker.take_cancelled() == ["r7"]
    finally:
        worker.stop()


def test_a_finished_request_is_in_the_metrics_before_its_final_response_leaves(make_loop):
    """Mirrors vllm_backend's L0_backend_vllm/metrics_test test_vllm_metrics, which scrapes
    the counters right after the last response: the step that finished a request has its
    metrics recorded before that request's FINAL response is sent (it was sent first, and
    a scrape then missed the request for a few milliseconds)."""
    order: list[tuple[str, object]] = []

    class Recorder:
        def record(self, step) -> None:
            order.append(("record", len(step.finished)))

    class OrderedSender(Sender):
        def send(self, response=None, flags: int = 0) -> None:
            if flags:
                order.append(("final", self))
            super().send(response, flags)

    engine = ScriptedEngine(max_running=2)
    loop = make_loop(engine, metrics=Recorder())
    senders = [OrderedSender() for _ in range(2)]
    for i, sender in enumerate(senders):
        loop.submit(inflight(f"r{i}", sender, max_tokens=2 + i))
    wait_all(senders)
    for sender in senders:
        final_at = order.index(("final", sender))
        assert any(kind == "record" and count for kind, count in order[:final_at]), order
    # Each final follows the record of the step that finished it, not an earlier one.
    finals = [i for i, (kind, _) in enumerate(order) if kind == "final"]
    records = [i for i, (kind, count) in enumerate(order) if kind == "record" and count]
    assert len(records) == 2 and records[0] < finals[0] < records[1] < finals[1], order


def test_an_engine_death_reads_as_vllm_backends_unhealthy_engine(make_loop):
    """Mirrors vllm_backend's L0_check_health_vllm test_vllm_not_healthy: requests after the
    engine failed get its text ("Model is unavailable due to unhealthy vLLM engine"), ours
    after it."""
    engine = ScriptedEngine(max_running=1)
    loop = make_loop(engine)
    engine.fail_stats = True
    sender = Sender()
    loop.submit(inflight("r0", sender))
    wait_all([sender])
    late = Sender()
    loop.submit(inflight("late", late))
    wait_all([late])
    for message in (sender.error.message, late.error.message, loop.refusal()):
        assert message.startswith("Model is unavailable due to unhealthy vLLM engine: "), message
        assert "engine stopped" in message and "stats broke" in message


def test_a_step_failed_by_a_bad_request_answers_invalid_arg(make_loop):
    """A grammar that did not compile is the request's fault (INVALID_ARG), not the engine's."""
    from engine.llm_engine import EngineStepError

    class BadGrammar(ScriptedEngine):
        def step(self):
            if "bad" in self.waiting:
                self.waiting.remove("bad")
                raise EngineStepError("grammar compile failed: bad: unsupported", ["bad"],
                                      bad_request=True)
            return super().step()

    engine = BadGrammar()
    loop = make_loop(engine)
    bad, good = Sender(), Sender()
    loop.submit(inflight("bad", bad))
    loop.submit(inflight("good", good))
    wait_all([bad, good])
    assert bad.error.code == "INVALID_ARG" and "grammar compile failed" in bad.error.message
    assert good.error is None
