"""The metric families the backend exports on Triton's metrics port: vLLM 0.32's names,
kinds, label names and bucket edges (its PrometheusStatLogger, vllm/v1/metrics/loggers.py
and buckets.py), so dashboards and alerts built for vLLM read a Triton-served model as
they read vLLM. tests/conformance/test_metrics_vllm.py holds them against vLLM's own
registry.

prometheus_client appends `_total` to a counter's name when it exposes it; Triton's
exposition does not, so the counters here carry it in the name. Every series also carries
vllm_backend's labels (`model`, `version`: triton-inference-server/vllm_backend
src/utils/metrics.py), so queries written for either read it."""
from __future__ import annotations

from dataclasses import dataclass

# Bucket edges as vLLM 0.32 defines them (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# vllm_backend's own family (its name for the inter-token latency), with its own edges.
VLLM_BACKEND_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                             1.0, 2.5)
# Token-count histograms: 1, 2, 5, 10, 20, 50, ... up to max_model_len.
REQUEST_TOKENS = "request_tokens"

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

# vLLM's label values of the enumerated labels, each series created up front as vLLM does.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    kind: str
    description: str
    # The label beyond the common ones, and its values (one series each).
    label: str = ""
    values: tuple[str, ...] = ()
    buckets: tuple[float, ...] | str = ()


def token_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 series for token counts, capped at max_model_len."""
    edges: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return edges
            edges.append(mantissa * scale)
        scale *= 10


FAMILIES = (
    Family("vllm:num_requests_running", GAUGE, "Number of requests in model execution batches."),
    Family("vllm:num_requests_waiting", GAUGE, "Number of requests waiting to be processed."),
    # Nothing here waits on a transient constraint (no LoRA budget, no KV transfer):
    # every waiting request waits for capacity.
    Family("vllm:num_requests_waiting_by_reason", GAUGE, "Number of waiting requests by reason.",
           "reason", WAITING_REASONS),
    # No sleep mode: the engine is always awake.
    Family("vllm:engine_sleep_state", GAUGE,
           "Engine sleep state; awake = 1 means the engine is awake.", "sleep_state", SLEEP_STATES),
    Family("vllm:kv_cache_usage_perc", GAUGE, "KV-cache usage. 1 means 100 percent usage."),
    Family("vllm:prefix_cache_queries_total", COUNTER,
           "Prefix cache queries, in terms of number of queried tokens."),
    Family("vllm:prefix_cache_hits_total", COUNTER,
           "Prefix cache hits, in terms of number of cached tokens."),
    Family("vllm:num_preemptions_total", COUNTER, "Cumulative number of preemptions from the engine."),
    Family("vllm:prompt_tokens_total", COUNTER, "Number of prefill tokens processed."),
    Family("vllm:prompt_tokens_by_source_total", COUNTER, "Number of prompt tokens by source.",
           "source", PROMPT_SOURCES),
    Family("vllm:prompt_tokens_cached_total", COUNTER,
           "Number of cached prompt tokens (local + external)."),
    Family("vllm:prompt_tokens_cached_by_source_total", COUNTER,
           "Prefix-cache hit tokens by the cache tier that supplied them.",
           "source", CACHE_HIT_SOURCES),
    Family("vllm:generation_tokens_total", COUNTER, "Number of generation tokens processed."),
    Family("vllm:request_success_total", COUNTER, "Count of successfully processed requests.",
           "finished_reason", FINISHED_REASONS),
    # Each instance enforces its own MAX_QUEUE_LEN, so its series also carries `engine`
    # (vLLM's frontend counts for the whole model and has no engine label here).
    Family("vllm:admission_rejections_total", COUNTER,
           "Number of admission attempts rejected by a queue limit, by reason.",
           "reason", ADMISSION_REASONS),
    # Ours (vLLM drops a full queue's batch with a log line only): routers' KV indexes
    # go stale by this many steps' events until they replay.
    Family("vllm:kv_events_dropped_total", COUNTER,
           "Number of KV-cache event batches dropped because the publisher's queue was full."),
    Family("vllm:request_prompt_tokens", HISTOGRAM, "Number of prefill tokens processed.",
           buckets=REQUEST_TOKENS),
    Family("vllm:request_generation_tokens", HISTOGRAM, "Number of generation tokens processed.",
           buckets=REQUEST_TOKENS),
    Family("vllm:iteration_tokens_total", HISTOGRAM, "Histogram of number of tokens per engine_step.",
           buckets=ITERATION_TOKENS_BUCKETS),
    Family("vllm:request_max_num_generation_tokens", HISTOGRAM,
           "Histogram of maximum number of requested generation tokens.", buckets=REQUEST_TOKENS),
    Family("vllm:request_params_n", HISTOGRAM, "Histogram of the n request parameter.",
           buckets=PARAMS_N_BUCKETS),
    Family("vllm:request_params_max_tokens", HISTOGRAM,
           "Histogram of the max_tokens request parameter.", buckets=REQUEST_TOKENS),
    Family("vllm:time_to_first_token_seconds", HISTOGRAM,
           "Histogram of time to first token in seconds.", buckets=TTFT_BUCKETS),
    Family("vllm:inter_token_latency_seconds", HISTOGRAM,
           "Histogram of inter-token latency in seconds.", buckets=ITL_BUCKETS),
    Family("vllm:time_per_output_token_seconds", HISTOGRAM,
           "Histogram of time per output token in seconds.", buckets=VLLM_BACKEND_TPOT_BUCKETS),
    Family("vllm:request_time_per_output_token_seconds", HISTOGRAM,
           "Histogram of time_per_output_token_seconds per request.", buckets=ITL_BUCKETS),
    Family("vllm:e2e_request_latency_seconds", HISTOGRAM,
           "Histogram of e2e request latency in seconds.", buckets=REQUEST_LATENCY_BUCKETS),
    Family("vllm:request_queue_time_seconds", HISTOGRAM,
           "Histogram of time spent in WAITING phase for request.", buckets=REQUEST_LATENCY_BUCKETS),
    Family("vllm:request_inference_time_seconds", HISTOGRAM,
           "Histogram of time spent in RUNNING phase for request.", buckets=REQUEST_LATENCY_BUCKETS),
    Family("vllm:request_prefill_time_seconds", HISTOGRAM,
           "Histogram of time spent in PREFILL phase for request.", buckets=REQUEST_LATENCY_BUCKETS),
    Family("vllm:request_decode_time_seconds", HISTOGRAM,
           "Histogram of time spent in DECODE phase for request.", buckets=REQUEST_LATENCY_BUCKETS),
    Family("vllm:request_num_preemptions", HISTOGRAM,
           "Number of preemptions per finished request.", buckets=NUM_PREEMPTIONS_BUCKETS),
    Family("vllm:request_prefill_kv_computed_tokens", HISTOGRAM,
           "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
           buckets=REQUEST_TOKENS),
)
BY_NAME = {family.name: family for family in FAMILIES}

# vLLM's info gauge: value 1, the KV cache's shape in its labels. Routers (the Gateway API
# inference extension's endpoint picker, llm-d) size a server's KV capacity from it.
CACHE_CONFIG_INFO = Family("vllm:cache_config_info", GAUGE, "Information of the LLMEngine CacheConfig")

# enable_lora only, as vLLM registers it only with a LoRA config: an info gauge whose
# value is the Unix time of the latest update and whose labels name the adapters with
# requests in flight. llm-d's endpoint picker reads the newest series for LoRA affinity.
LORA_REQUESTS_INFO = Family("vllm:lora_requests_info", GAUGE, "Running stats on lora requests.")
LORA_INFO_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")

# speculative_config only, as vLLM registers them only then (its SpecDecodingProm,
# vllm/v1/spec_decode/metrics.py): drafts verified, tokens drafted and accepted, and the
# drafts whose token at each position was accepted (one series per position 0..k-1).
SPEC_DECODE_FAMILIES = (
    Family("vllm:spec_decode_num_drafts_total", COUNTER, "Number of spec decoding drafts."),
    Family("vllm:spec_decode_num_draft_tokens_total", COUNTER, "Number of draft tokens."),
    Family("vllm:spec_decode_num_accepted_tokens_total", COUNTER, "Number of accepted tokens."),
)
SPEC_DECODE_PER_POS = Family("vllm:spec_decode_num_accepted_tokens_per_pos_total", COUNTER,
                             "Accepted tokens per draft position.", "position")
