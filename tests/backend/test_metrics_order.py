"""backend.metrics.TritonMetrics against a stand-in for pb_utils.MetricFamily that logs
every update in order: Triton may scrape between any two of them, so a request must be
counted in vllm:request_success_total only once everything else it and its step record is
there (tests/conformance/test_metrics_vllm.py scrapes the real server and once caught it
half-recorded: success 1, request_params_max_tokens still 0)."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from backend import metrics as engine_metrics
from backend.metrics import FinishedRequest, StepMetrics


def _stub_families(monkeypatch):
    """A stand-in for pb_utils.MetricFamily: every update in order in `log` (name,
    operation), and each series made in `made`: (family, its labels) -> [value]; the
    families' descriptions and kinds in `kinds`."""
    log: list[tuple[str, str]] = []
    made: dict[tuple[str, tuple], list[float]] = {}
    kinds: dict[str, tuple[str, str]] = {}

    class Series:
        def __init__(self, name, labels):
            self.name = name
            self.value = made.setdefault((name, tuple(sorted(labels.items()))), [0.0])

        def increment(self, amount):
            log.append((self.name, "increment"))
            self.value[0] += amount

        def observe(self, value):
            log.append((self.name, "observe"))

        def set(self, value):
            log.append((self.name, "set"))
            self.value[0] = value

    class MetricFamily:
        GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

        def __init__(self, name, description, kind):
            self.name = name
            kinds[name] = (kind, description)

        def Metric(self, labels, **kwargs):
            return Series(self.name, labels)

    stub = type(sys)("triton_python_backend_utils")
    stub.MetricFamily = MetricFamily
    monkeypatch.setitem(sys.modules, stub.__name__, stub)
    return log, made, kinds


@pytest.fixture
def updates(monkeypatch):
    log, _, _ = _stub_families(monkeypatch)
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


SPEC_FAMILIES = {  # vLLM 0.32's (vllm/v1/spec_decode/metrics.py SpecDecodingProm)
    "vllm:spec_decode_num_drafts_total": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens_total": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens_total": "Number of accepted tokens.",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": "Accepted tokens per draft position.",
}


def _spec_stats(drafts, draft_tokens, accepted, per_pos):
    from engine.spec_decode.metrics import SpecDecodingStats

    spec = SpecDecodingStats(len(per_pos), drafts, draft_tokens, accepted, list(per_pos))
    return SimpleNamespace(num_running=1, num_waiting=0, kv_cache_usage=0.1,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions_total=0,
                           prompt_tokens_total=0, generation_tokens_total=0,
                           kv_events_dropped_total=0, tenant_tokens_served={}, tenant_waiting={},
                           spec_decoding=spec)


def test_spec_decode_families_only_with_a_speculative_config(monkeypatch):
    _, _, kinds = _stub_families(monkeypatch)
    metrics = engine_metrics.TritonMetrics("llm", "1")
    metrics.engine_ready(16, 1000, 1024)
    assert not any(name.startswith("vllm:spec_decode") for name in kinds)
    # An engine without speculation reports spec_decoding=None; nothing to record.
    metrics.record(StepMetrics(stats=SimpleNamespace(**{**vars(_spec_stats(0, 0, 0, [0])),
                                                        "spec_decoding": None})))
    assert not any(name.startswith("vllm:spec_decode") for name in kinds)
    engine_metrics.NullMetrics().engine_ready(16, 1000, 1024, max_loras=None,
                                              num_speculative_tokens=3)


def test_spec_decode_counters_mirror_the_engines_totals(monkeypatch):
    log, made, kinds = _stub_families(monkeypatch)
    metrics = engine_metrics.TritonMetrics("llm", "1")
    metrics.engine_ready(16, 1000, 1024, num_speculative_tokens=3)
    assert {name: kinds[name] for name in SPEC_FAMILIES} == {
        name: ("counter", description) for name, description in SPEC_FAMILIES.items()}

    def value(name, **extra):
        labels = {"model_name": "llm", "engine": "0", "model": "llm", "version": "1", **extra}
        return made[(name, tuple(sorted(labels.items())))][0]

    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    # One series per position, created at 0 before any draft, as vLLM's.
    assert sorted(key[1] for key in made if key[0] == per_pos) == sorted(
        tuple(sorted({"model_name": "llm", "engine": "0", "model": "llm", "version": "1",
                      "position": str(p)}.items())) for p in range(3))
    assert value(per_pos, position="2") == 0
    metrics.record(StepMetrics(stats=_spec_stats(2, 6, 4, [2, 1, 1])))
    metrics.record(StepMetrics(stats=_spec_stats(2, 6, 4, [2, 1, 1])))  # no new draft
    metrics.record(StepMetrics(stats=_spec_stats(5, 15, 7, [4, 2, 1])))
    assert value("vllm:spec_decode_num_drafts_total") == 5
    assert value("vllm:spec_decode_num_draft_tokens_total") == 15
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 7
    assert [value(per_pos, position=str(p)) for p in range(3)] == [4, 2, 1]
    # An unchanged total costs no update (each one is an IPC round trip to Triton).
    spec_updates = [name for name, _ in log if name.startswith("vllm:spec_decode")]
    assert len(spec_updates) == 6 + 5  # first step: all six; third: all but position 2
