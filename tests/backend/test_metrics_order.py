"""backend.metrics.TritonMetrics against a stand-in for pb_utils.MetricFamily that logs
every update in order: Triton may scrape between any two of them, so a request must be
counted in vllm:request_success_total only once everything else it and its step record is
there (tests/conformance/test_metrics_vllm.py scrapes the real server and once caught it
half-recorded: success 1, request_params_max_tokens still 0)."""
from __future__ import annotations

import sys

import pytest

from backend import metrics as engine_metrics
from backend.metrics import FinishedRequest, StepMetrics


@pytest.fixture
def updates(monkeypatch):
    log: list[tuple[str, str]] = []

    class Series:
        def __init__(self, name):
            self.name = name

        def increment(self, amount):
            log.append((self.name, "increment"))

        def observe(self, value):
            log.append((self.name, "observe"))

        def set(self, value):
            log.append((self.name, "set"))

    class MetricFamily:
        GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels, **kwargs):
            return Series(self.name)

    stub = type(sys)("triton_python_backend_utils")
    stub.MetricFamily = MetricFamily
    monkeypatch.setitem(sys.modules, stub.__name__, stub)
    metrics = engine_metrics.TritonMetrics("llm", "1")
    metrics.engine_ready(16, 1000, 1024)
    log.clear()
    return metrics, log


def _finished(reason: str) -> FinishedRequest:
    return FinishedRequest(reason, num_prompt_tokens=7, num_generation_tokens=8, e2e=0.5,
                           queued=0.01, prefill=0.1, decode=0.3, inference=0.4,
                           max_tokens_param=8)


def test_a_request_is_counted_after_everything_it_and_its_step_record(updates):
    metrics, log = updates
    metrics.record(StepMetrics(ttft=[0.1], itl=[0.02], iteration_tokens=[9],
                               finished=[_finished("length"), _finished("a reason we lack")],
                               n_params=[1], max_generation_tokens=[8], prompt_computed=7,
                               num_cancelled=1))
    names = [name for name, _ in log]
    successes = [i for i, name in enumerate(names) if name == "vllm:request_success_total"]
    assert len(successes) == 3  # length, error (the unknown reason), abort
    others = [i for i, name in enumerate(names) if name != "vllm:request_success_total"]
    assert max(others) < min(successes)
    # The request's own series, and the step's, were all recorded before that.
    for name in ("vllm:request_params_max_tokens", "vllm:e2e_request_latency_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_generation_tokens",
                 "vllm:iteration_tokens_total", "vllm:prompt_tokens_by_source_total"):
        assert name in names[:min(successes)], name
