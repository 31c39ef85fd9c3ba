"""vLLM's metrics (backend/metric_families.py) on Triton's metrics port, through
pb_utils.MetricFamily.

Each metric update is an IPC round trip to the server process, so the engine loop never
calls these directly: it collects one StepMetrics per step and the response worker
thread records it."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from backend.metric_families import (BY_NAME, CACHE_CONFIG_INFO, COUNTER, FAMILIES, GAUGE,
                                     LORA_REQUESTS_INFO, REQUEST_TOKENS, Family, token_buckets)
from backend.spec_decode_metrics import SpecDecodeMetrics
from backend.tenant_metrics import TenantMetrics

# vllm:lora_requests_info keeps a series per label combination seen, as prometheus_client
# does for vLLM; past this many the oldest are dropped (Triton removes a dropped Metric).
_MAX_LORA_SERIES = 256
# The newest series' value is refreshed at most this often while its labels stay the same.
_LORA_INFO_REFRESH_S = 1.0

# The engine's cumulative counters (EngineStats fields), mirrored by adding the increase
# since the previous step. vLLM counts the device prefix-cache hits by source too.
# Each target: (family, the value of its extra label or None).
_STAT_COUNTERS = {
    "prefix_cache_queries": (("vllm:prefix_cache_queries_total", None),),
    "prefix_cache_hits": (("vllm:prefix_cache_hits_total", None),
                          ("vllm:prompt_tokens_cached_by_source_total", "device")),
    "num_preemptions_total": (("vllm:num_preemptions_total", None),),
    "prompt_tokens_total": (("vllm:prompt_tokens_total", None),),
    "generation_tokens_total": (("vllm:generation_tokens_total", None),),
    "kv_events_dropped_total": (("vllm:kv_events_dropped_total", None),),
}
_STAT_GAUGES = {
    "num_running": (("vllm:num_requests_running", None),),
    "num_waiting": (("vllm:num_requests_waiting", None),
                    ("vllm:num_requests_waiting_by_reason", "capacity")),
    "kv_cache_usage": (("vllm:kv_cache_usage_perc", None),),
}


@dataclass(slots=True)
class FinishedRequest:
    """One finished sequence, in vLLM's terms (vllm/v1/metrics/stats.py FinishedRequestStats):
    queued = arrival..first scheduled, prefill = first scheduled..first token,
    decode = first..last token, inference = first scheduled..last token."""
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    e2e: float = 0.0
    queued: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0
    inference: float = 0.0
    max_tokens_param: int | None = None

    @property
    def mean_time_per_output_token(self) -> float:
        return self.decode / (self.num_generation_tokens - 1) if self.num_generation_tokens > 1 else 0.0


@dataclass(slots=True)
class StepMetrics:
    """What one engine step contributed; `stats` is the engine's get_stats() after it."""
    stats: Any = None
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    # Tokens the step computed: prompt tokens plus sampled ones (vLLM's iteration tokens).
    iteration_tokens: list[int] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    # Per request (the parent when n > 1), once all of its sequences finished.
    n_params: list[int] = field(default_factory=list)
    max_generation_tokens: list[int] = field(default_factory=list)
    # Prompt tokens of the requests that got their first token, by where their KV came from.
    prompt_computed: int = 0
    prompt_cached: int = 0
    num_rejected: int = 0  # refused as "server busy" since the previous record
    num_cancelled: int = 0  # cancelled by their client since the previous record

    def empty(self) -> bool:
        return not (self.stats or self.ttft or self.itl or self.iteration_tokens or self.finished
                    or self.n_params or self.prompt_computed or self.prompt_cached
                    or self.num_rejected or self.num_cancelled)


class NullMetrics:
    """REPORT_CUSTOM_METRICS off."""

    def record(self, step: StepMetrics) -> None:
        pass

    def engine_ready(self, block_size: int, num_gpu_blocks: int, max_model_len: int,
                     max_loras: int | None = None,
                     num_speculative_tokens: int | None = None) -> None:
        pass


class TritonMetrics:
    def __init__(self, model_name: str, model_version: str, engine: int = 0) -> None:
        import triton_python_backend_utils as pb_utils

        self._kinds = pb_utils.MetricFamily
        # vLLM's labels (engine: the data-parallel rank, here the instance's index, so
        # instance_group count > 1 gives a series per engine) and vllm_backend's.
        self._labels = {"model_name": model_name, "engine": str(engine),
                        "model": model_name, "version": str(model_version)}
        # Triton invalidates a Metric once its MetricFamily is garbage collected, so the
        # families live as long as this object.
        self._families: list = []
        # name -> the series, or {label value: series} for a family with an extra label.
        self._series: dict[str, Any] = {}
        for family in FAMILIES:
            if family.buckets != REQUEST_TOKENS:
                self._add(family)
        for state, series in self._series["vllm:engine_sleep_state"].items():
            series.set(1 if state == "awake" else 0)
        self._last_gauge: dict[str, float] = {}
        self._last_counter: dict[str, float] = {attr: 0 for attr in _STAT_COUNTERS}
        # enable_lora: vllm:lora_requests_info's family, its series by label values, and
        # the labels and time of the latest update.
        self._lora_family: Any = None
        self._max_loras = 0
        self._lora_series: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lora_last: tuple[tuple[str, str], float] | None = None
        self._spec_decode: SpecDecodeMetrics | None = None  # speculative_config only
        self._tenants = TenantMetrics(self._kinds, self._labels)

    def _add(self, family: Family, buckets: list[float] | None = None,
             labels: dict[str, str] | None = None) -> Any:
        kind = {GAUGE: self._kinds.GAUGE, COUNTER: self._kinds.COUNTER}.get(
            family.kind, self._kinds.HISTOGRAM)
        handle = self._kinds(name=family.name, description=family.description, kind=kind)
        self._families.append(handle)
        labels = self._labels if labels is None else labels
        kwargs = {}
        if family.kind not in (GAUGE, COUNTER):
            kwargs["buckets"] = list(buckets if buckets is not None else family.buckets)
        if family.label:
            series = {value: handle.Metric(labels={**labels, family.label: value}, **kwargs)
                      for value in family.values}
        else:
            series = handle.Metric(labels=labels, **kwargs)
        self._series[family.name] = series
        return series

    def engine_ready(self, block_size: int, num_gpu_blocks: int, max_model_len: int,
                     max_loras: int | None = None,
                     num_speculative_tokens: int | None = None) -> None:
        """Once, when the engine is built: the pool's size and the context length (the
        token histograms' edges) are known only then. vLLM names the pool's block count
        num_gpu_blocks whatever the device, so the label does too. num_speculative_tokens:
        speculative_config's (None: off), the spec-decode families' positions."""
        edges = token_buckets(max_model_len)
        for family in FAMILIES:
            if family.buckets == REQUEST_TOKENS:
                self._add(family, buckets=edges)
        # vLLM's info gauge is labelled with CacheConfig's fields and the engine only.
        labels = {key: value for key, value in self._labels.items() if key != "model_name"}
        info = self._add(CACHE_CONFIG_INFO, labels={**labels, "block_size": str(block_size),
                                                    "num_gpu_blocks": str(num_gpu_blocks)})
        info.set(1)
        if max_loras is not None:
            self._max_loras = max_loras
            self._lora_family = self._kinds(name=LORA_REQUESTS_INFO.name,
                                            description=LORA_REQUESTS_INFO.description,
                                            kind=self._kinds.GAUGE)
        if num_speculative_tokens is not None:
            self._spec_decode = SpecDecodeMetrics(self._kinds, self._labels, num_speculative_tokens)

    def _one(self, name: str, value: str | None = None) -> Any:
        series = self._series[name]
        return series if value is None else series[value]

    def record(self, step: StepMetrics) -> None:
        """Triton may scrape between any two updates, so a finished request is counted in
        vllm:request_success_total last, after the step's other series and its own: a
        scraper that sees it counted sees all of its figures (the conformance test waits
        on that count, and once read the rest 0 under load)."""
        if step.stats is not None:
            self._record_stats(step.stats)
        observe = self._observe
        observe("vllm:time_to_first_token_seconds", step.ttft)
        observe("vllm:inter_token_latency_seconds", step.itl)
        observe("vllm:time_per_output_token_seconds", step.itl)  # vllm_backend's name for it
        observe("vllm:iteration_tokens_total", step.iteration_tokens)
        observe("vllm:request_params_n", step.n_params)
        observe("vllm:request_max_num_generation_tokens", step.max_generation_tokens)
        self._increment("vllm:prompt_tokens_by_source_total", step.prompt_computed, "local_compute")
        self._increment("vllm:prompt_tokens_by_source_total", step.prompt_cached, "local_cache_hit")
        self._increment("vllm:prompt_tokens_cached_total", step.prompt_cached)
        self._increment("vllm:admission_rejections_total", step.num_rejected, "max_num_queued_reqs")
        for request in step.finished:
            self._record_finished(request)
        for request in step.finished:
            self._increment("vllm:request_success_total", 1, self._success_reason(request))
        self._increment("vllm:request_success_total", step.num_cancelled, "abort")

    def _record_lora_info(self, stats: Any) -> None:
        """vLLM's labels: the adapters joined by commas; the value: now, as vLLM's
        set_to_current_time, so a reader takes the series updated last."""
        key = (",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters))
        now = time.time()
        last = self._lora_last
        if last is not None and last[0] == key and now - last[1] < _LORA_INFO_REFRESH_S:
            return
        series = self._lora_series.get(key)
        if series is None:
            labels = {key_: value for key_, value in self._labels.items() if key_ != "model_name"}
            series = self._lora_family.Metric(labels={
                **labels, "max_lora": str(self._max_loras), "waiting_lora_adapters": key[0],
                "running_lora_adapters": key[1]})
            self._lora_series[key] = series
            while len(self._lora_series) > _MAX_LORA_SERIES:
                self._lora_series.popitem(last=False)
        else:
            self._lora_series.move_to_end(key)
        series.set(now)
        self._lora_last = (key, now)

    def _record_stats(self, stats: Any) -> None:
        if self._lora_family is not None:
            self._record_lora_info(stats)
        self._tenants.record(stats)
        for attr, targets in _STAT_GAUGES.items():
            value = float(getattr(stats, attr))
            if self._last_gauge.get(attr) != value:
                for name, label_value in targets:
                    self._one(name, label_value).set(value)
                self._last_gauge[attr] = value
        for attr, targets in _STAT_COUNTERS.items():
            value = float(getattr(stats, attr))
            if value > self._last_counter[attr]:
                for name, label_value in targets:
                    self._one(name, label_value).increment(value - self._last_counter[attr])
                self._last_counter[attr] = value
        spec = getattr(stats, "spec_decoding", None)
        if spec is not None and self._spec_decode is not None:
            self._spec_decode.record(spec)

    @staticmethod
    def _success_reason(request: FinishedRequest) -> str:
        reason = request.finish_reason
        if reason not in BY_NAME["vllm:request_success_total"].values:
            reason = "error"  # an unknown finish reason still counts, as a failure
        return reason

    def _record_finished(self, request: FinishedRequest) -> None:
        """The request's own series; record() counts it in request_success_total after."""
        observe = self._observe
        observe("vllm:e2e_request_latency_seconds", [request.e2e])
        observe("vllm:request_queue_time_seconds", [request.queued])
        observe("vllm:request_prefill_time_seconds", [request.prefill])
        observe("vllm:request_inference_time_seconds", [request.inference])
        observe("vllm:request_decode_time_seconds", [request.decode])
        observe("vllm:request_num_preemptions", [request.num_preemptions])
        observe("vllm:request_prefill_kv_computed_tokens",
                [request.num_prompt_tokens - max(request.num_cached_tokens, 0)])
        observe("vllm:request_prompt_tokens", [request.num_prompt_tokens])
        observe("vllm:request_generation_tokens", [request.num_generation_tokens])
        observe("vllm:request_time_per_output_token_seconds", [request.mean_time_per_output_token])
        if request.max_tokens_param:
            observe("vllm:request_params_max_tokens", [request.max_tokens_param])

    def _observe(self, name: str, values: list[float] | list[int]) -> None:
        if values:
            series = self._one(name)
            for value in values:
                series.observe(float(value))

    def _increment(self, name: str, amount: float, value: str | None = None) -> None:
        if amount > 0:
            self._one(name, value).increment(float(amount))
