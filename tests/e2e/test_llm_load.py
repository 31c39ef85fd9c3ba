"""Concurrency, cancellation and metrics of the `llm` model (real server)."""
from __future__ import annotations

import time

import pytest
import tritonclient.grpc as grpcclient

from tests.e2e.shared import PROMPTS, greedy
from tests.e2e.triton_clients import infer_many, llm_inputs, metric, scrape_metrics, tensors_to_inputs

pytestmark = pytest.mark.slow


def wait_metric(server, name: str, model: str, predicate, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = metric(scrape_metrics(server.metrics), name, model)
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_64_concurrent_streams_mixed_lengths(server, reference):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " + "word " * (i % 13) for i in range(64)]
    lengths = [4 + (i * 7) % 60 for i in range(64)]
    expected = reference.generate(prompts, [greedy(n) for n in lengths])
    outcomes = infer_many(server.grpc, "llm", [
        llm_inputs(p, {"temperature": 0, "max_tokens": n}, stream=True) for p, n in zip(prompts, lengths)])
    assert [o.text for o in outcomes] == [e.outputs[0].text for e in expected]
    assert all(o.final for o in outcomes)
    assert wait_metric(server, "vllm:kv_cache_usage_perc", "llm", lambda v: v == 0) == 0
    assert wait_metric(server, "vllm:num_requests_running", "llm", lambda v: v == 0) == 0


def test_cancellation_stops_generation_and_frees_kv_blocks(server):
    # 480 forced tokens each (prompt + 480 < max_model_len 512): ~2-5 s of decoding for the
    # three here, so only the counters below, not the wait, tell a cancel from a finish.
    num_tokens, num_requests = 480, 3
    before = metric(scrape_metrics(server.metrics), "vllm:generation_tokens_total", "llm")
    received, errors = [], []

    def callback(result, error):
        (errors if error is not None else received).append(error if error is not None else result)

    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=callback)
    for i in range(num_requests):
        client.async_stream_infer("llm", tensors_to_inputs(llm_inputs(
            PROMPTS[i], {"max_tokens": num_tokens, "min_tokens": num_tokens}, stream=True)),
            request_id=str(i))
    deadline = time.monotonic() + 60
    while len(received) < 2 * num_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(received) >= 2 * num_requests, "streams did not start"
    assert wait_metric(server, "vllm:kv_cache_usage_perc", "llm", lambda v: v > 0, timeout=5) > 0
    client.stop_stream(cancel_requests=True)
    cancelled_at = time.monotonic()
    client.close()
    assert errors and all(e.status() == "StatusCode.CANCELLED" for e in errors), errors
    assert not any(r.get_response().parameters["triton_final_response"].bool_param for r in received)
    assert wait_metric(server, "vllm:kv_cache_usage_perc", "llm", lambda v: v == 0, timeout=5) == 0
    assert time.monotonic() - cancelled_at < 5
    assert wait_metric(server, "vllm:num_requests_running", "llm", lambda v: v == 0, timeout=5) == 0
    # The server stopped decoding: far fewer tokens than the requests would have made.
    time.sleep(0.5)
    generated = metric(scrape_metrics(server.metrics), "vllm:generation_tokens_total", "llm") - before
    assert len(received) < num_requests * num_tokens / 4
    assert generated < num_requests * num_tokens / 4, generated


def test_token_counters_match_what_was_sent(server):
    before = scrape_metrics(server.metrics)
    outcomes = infer_many(server.grpc, "llm", [
        llm_inputs(p, {"temperature": 0, "max_tokens": 5 + i}, stream=True, return_num_input_tokens=True,
                   return_num_output_tokens=True) for i, p in enumerate(PROMPTS)])
    prompt_tokens = sum(int(o.responses[0]["num_input_tokens"][0]) for o in outcomes)
    output_tokens = sum(int(r["num_output_tokens"][0]) for o in outcomes for r in o.responses)
    base_p = metric(before, "vllm:prompt_tokens_total", "llm")
    base_g = metric(before, "vllm:generation_tokens_total", "llm")
    got_p = wait_metric(server, "vllm:prompt_tokens_total", "llm", lambda v: v >= base_p + prompt_tokens)
    got_g = wait_metric(server, "vllm:generation_tokens_total", "llm", lambda v: v >= base_g + output_tokens)
    assert got_p - base_p == prompt_tokens
    assert got_g - base_g == output_tokens
    after = scrape_metrics(server.metrics)
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count"):
        assert metric(after, name, "llm") - metric(before, name, "llm") == len(PROMPTS), name
    assert metric(after, "vllm:inter_token_latency_seconds_count", "llm") > metric(
        before, "vllm:inter_token_latency_seconds_count", "llm")
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:num_requests_waiting"):
        metric(after, name, "llm")  # exported
