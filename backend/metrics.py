"""vLLM-named metrics on Triton's metrics port via pb_utils.MetricFamily.

Each metric update is an IPC round trip to the server process, so the engine loop
never calls these directly: it collects one StepMetrics per step and the response
worker thread records it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Bucket edges as vLLM uses them, so dashboards built for vLLM read the same.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

_GAUGES = {
    "vllm:num_requests_running": ("Number of requests in model execution batches.", "num_running"),
    "vllm:num_requests_waiting": ("Number of requests waiting to be processed.", "num_waiting"),
    "vllm:kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
}
# Cumulative engine counters, mirrored by adding the increase since the last step.
_STAT_COUNTERS = {
    "vllm:prefix_cache_queries": ("Prefix cache queries, in terms of number of queried tokens.",
                                  "prefix_cache_queries"),
    "vllm:prefix_cache_hits": ("Prefix cache hits, in terms of number of cached tokens.",
                               "prefix_cache_hits"),
    "vllm:num_preemptions_total": ("Cumulative number of preemptions from the engine.",
                                   "num_preemptions_total"),
    "vllm:prompt_tokens_total": ("Number of prefill tokens processed.", "prompt_tokens_total"),
    "vllm:generation_tokens_total": ("Number of generation tokens processed.",
                                     "generation_tokens_total"),
}
# vLLM's info gauge: value 1, the KV cache's shape in its labels. Routers (the Gateway API
# inference extension's endpoint picker, llm-d) size a server's KV capacity from it.
CACHE_CONFIG_INFO = ("vllm:cache_config_info", "Information of the LLMEngine CacheConfig")
# Not a vLLM metric (vLLM queues without bound), hence the project's own prefix.
REJECTED_COUNTER = ("tle:num_requests_rejected_total",
                    "Requests refused with UNAVAILABLE because MAX_QUEUE_LEN requests were queued.")
_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.",
                                         "ttft", TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.",
                                         "itl", ITL_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of end to end request latency in seconds.",
                                         "e2e", REQUEST_BUCKETS),
    "vllm:request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.",
                                        "queue", REQUEST_BUCKETS),
}


@dataclass(slots=True)
class StepMetrics:
    """What one engine step contributed; `stats` is the engine's get_stats() after it."""
    stats: Any = None
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    num_rejected: int = 0  # refused as "server busy" since the previous record

    def empty(self) -> bool:
        return not (self.stats or self.ttft or self.itl or self.e2e or self.queue or self.num_rejected)


class NullMetrics:
    """REPORT_CUSTOM_METRICS off."""

    def record(self, step: StepMetrics) -> None:
        pass

    def report_cache_config(self, block_size: int, num_gpu_blocks: int) -> None:
        pass


class TritonMetrics:
    def __init__(self, model_name: str, model_version: str, instance_name: str = "") -> None:
        import triton_python_backend_utils as pb_utils

        self._kinds = kinds = pb_utils.MetricFamily
        # vllm_backend's labels, plus the instance: with instance_group count > 1 each
        # instance's engine reports its own series (sum by model for the whole model).
        self._labels = {"model": model_name, "version": str(model_version),
                        "instance": instance_name}
        # Triton invalidates a Metric once its MetricFamily is garbage collected, so the
        # families live as long as this object.
        self._families: list = []
        metric = self._metric
        self._gauges = {attr: metric(name, desc, kinds.GAUGE) for name, (desc, attr) in _GAUGES.items()}
        self._stat_counters = {attr: metric(name, desc, kinds.COUNTER)
                               for name, (desc, attr) in _STAT_COUNTERS.items()}
        self._histograms = {attr: metric(name, desc, kinds.HISTOGRAM, buckets=buckets)
                            for name, (desc, attr, buckets) in _HISTOGRAMS.items()}
        self._rejected = metric(*REJECTED_COUNTER, kinds.COUNTER)
        self._cache_info: Any = None
        self._last_gauge: dict[str, float] = {}
        self._last_counter: dict[str, float] = {attr: 0 for attr in self._stat_counters}

    def _metric(self, name: str, desc: str, kind: Any, extra_labels: dict[str, str] | None = None,
                **kwargs: Any) -> Any:
        family = self._kinds(name=name, description=desc, kind=kind)
        self._families.append(family)
        return family.Metric(labels={**self._labels, **(extra_labels or {})}, **kwargs)

    def report_cache_config(self, block_size: int, num_gpu_blocks: int) -> None:
        """Once, when the engine is built: its pool's size is known only then. vLLM names
        the pool's block count num_gpu_blocks whatever the device, so the label does too."""
        self._cache_info = self._metric(
            *CACHE_CONFIG_INFO, self._kinds.GAUGE,
            extra_labels={"block_size": str(block_size), "num_gpu_blocks": str(num_gpu_blocks)})
        self._cache_info.set(1)

    def record(self, step: StepMetrics) -> None:
        if step.stats is not None:
            for attr, metric in self._gauges.items():
                value = float(getattr(step.stats, attr))
                if self._last_gauge.get(attr) != value:
                    metric.set(value)
                    self._last_gauge[attr] = value
            for attr, metric in self._stat_counters.items():
                value = float(getattr(step.stats, attr))
                if value > self._last_counter[attr]:
                    metric.increment(value - self._last_counter[attr])
                    self._last_counter[attr] = value
        for attr, metric in self._histograms.items():
            for value in getattr(step, attr):
                metric.observe(value)
        if step.num_rejected:
            self._rejected.increment(step.num_rejected)
