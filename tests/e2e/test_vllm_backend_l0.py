"""vllm_backend's own CI tests (its ci/L0_* folders), their behaviours checked here against
the session's real tritonserver: `llm` (the tiny random-weight Llama) and `llm_default`
(SmolLM2, for tests that need real text). Each test names the upstream test it mirrors;
the upstream texts they compare whole (error messages) are compared whole here too.
Behaviours already covered elsewhere: exclude_input_in_output defaults and load/unload
(test_llm_text.py, test_vllm_dropin.py), a python model loaded at run time under serve.py
(test_vllm_backend_serve.py)."""
from __future__ import annotations

import json
import queue
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.e2e.shared import PROMPTS
from tests.e2e.triton_clients import (infer_many, infer_one, llm_inputs, metric, scrape_metrics,
                                      tensors_to_inputs)

pytestmark = pytest.mark.slow

STREAM_ERROR = ("Error generating stream: When streaming, `exclude_input_in_output` = False is "
                "not allowed.")
ENGLISH = "The most dangerous animal is"


def test_enabled_stream_sends_the_engines_deltas(server):
    """Mirrors L0_backend_vllm/enabled_stream test_vllm_model_enabled_stream and
    ..._exclude_input_in_output_default: several prompts streamed on one gRPC stream, each
    response the text new since the last, together the non-streamed text without the
    prompt; every token rides on exactly one response."""
    sampling = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    prompts = PROMPTS[:2]
    whole = [infer_one(server.grpc, "llm", llm_inputs(p, sampling, exclude_input_in_output=True))
             for p in prompts]
    streamed = infer_many(server.grpc, "llm", [
        llm_inputs(p, sampling, stream=True, return_num_output_tokens=True) for p in prompts])
    for outcome, alone in zip(streamed, whole):
        assert outcome.error is None and alone.error is None
        assert len(outcome.responses) > 1
        assert outcome.text == alone.text
        assert sum(int(r["num_output_tokens"][0]) for r in outcome.responses) == 16


def test_streaming_with_the_prompt_prepended_gets_vllm_backends_error(server):
    """Mirrors L0_backend_vllm/enabled_stream
    test_vllm_model_enabled_stream_exclude_input_in_output_false (message compared whole)."""
    outcome = infer_one(server.grpc, "llm", llm_inputs(ENGLISH, {"max_tokens": 4}, stream=True,
                                                       exclude_input_in_output=False))
    assert outcome.error == STREAM_ERROR
    assert infer_one(server.grpc, "llm", llm_inputs(ENGLISH, {"max_tokens": 4}, stream=True)).error is None


def test_request_cancellation(server):
    """Mirrors L0_backend_vllm/request_cancellation test_request_cancellation: a long
    non-streamed request, the client's stream stopped with cancel_requests: one CANCELLED
    error and nothing else, and the server log has vllm_backend's two lines."""
    answers: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    sampling = {"temperature": "0", "top_p": "1", "max_tokens": "400", "min_tokens": "400"}
    client.async_stream_infer("llm", tensors_to_inputs(llm_inputs("Write a poem.", sampling)),
                              request_id="1")
    # The request runs (its prompt was tokenized and scheduled) before the stream is cut.
    deadline = time.monotonic() + 60
    while not _running(server, "llm"):
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)
    client.stop_stream(cancel_requests=True)
    answer = answers.get(timeout=30)
    client.close()
    assert isinstance(answer, InferenceServerException), answer
    assert answer.status() == "StatusCode.CANCELLED"
    assert answers.empty()
    deadline = time.monotonic() + 30
    log = server.handle.log_path
    while "[vllm] Successfully cancelled the request" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "vllm_backend's cancellation lines not logged"
        time.sleep(0.1)
    assert "[vllm] Cancelling the request" in log.read_text(errors="replace")


def _running(server, model: str) -> bool:
    return metric(scrape_metrics(server.metrics), "vllm:num_requests_running", model) > 0


def test_vllm_metrics_right_after_the_last_response(server):
    """Mirrors L0_backend_vllm/metrics_test test_vllm_metrics: three prompts, twice, on a
    gRPC stream, and the counters scraped as soon as the last response is in (they were
    recorded after the responses were sent, and a scrape then missed a few ms of them)."""
    model = "llm"
    sampling = {"temperature": "0", "top_p": "1", "max_tokens": "16"}
    flags = {"return_num_input_tokens": True, "return_num_output_tokens": True}
    names = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
             "vllm:request_prompt_tokens_count", "vllm:request_prompt_tokens_sum",
             "vllm:request_generation_tokens_count", "vllm:request_generation_tokens_sum",
             "vllm:time_per_output_token_seconds_count")
    # The session's server is shared: a request of an earlier test (a cancelled stream's
    # last steps) may still be generating, which would count here.
    deadline = time.monotonic() + 30
    while True:
        before = scrape_metrics(server.metrics)
        if (metric(before, "vllm:num_requests_running", model) == 0
                and metric(before, "vllm:num_requests_waiting", model) == 0):
            break
        assert time.monotonic() < deadline, "the server never went idle"
        time.sleep(0.2)
    prompt_tokens = generation_tokens = requests_done = 0
    for _ in range(2):
        outcomes = infer_many(server.grpc, model, [llm_inputs(p, sampling, **flags)
                                                   for p in PROMPTS[:3]])
        for outcome in outcomes:
            assert outcome.error is None
            (response,) = outcome.responses
            prompt_tokens += int(response["num_input_tokens"][0])
            generation_tokens += int(response["num_output_tokens"][0])
            requests_done += 1
    after = scrape_metrics(server.metrics)  # at once: no wait for the counters
    delta = {name: metric(after, name, model) - metric(before, name, model) for name in names}
    assert delta == {
        "vllm:prompt_tokens_total": prompt_tokens,
        "vllm:generation_tokens_total": generation_tokens,
        "vllm:time_to_first_token_seconds_count": requests_done,
        "vllm:e2e_request_latency_seconds_count": requests_done,
        "vllm:request_prompt_tokens_count": requests_done,
        "vllm:request_prompt_tokens_sum": prompt_tokens,
        "vllm:request_generation_tokens_count": requests_done,
        "vllm:request_generation_tokens_sum": generation_tokens,
        "vllm:time_per_output_token_seconds_count": generation_tokens - requests_done,
    }


def test_custom_sampling_params_are_in_request_params_n(server):
    """Mirrors L0_backend_vllm/metrics_test test_custom_sampling_params (n=2)."""
    before = scrape_metrics(server.metrics)
    sampling = {"temperature": "1", "top_p": "1", "n": "2", "max_tokens": "4"}
    for outcome in infer_many(server.grpc, "llm", [llm_inputs(p, sampling) for p in PROMPTS[:3]]):
        assert outcome.error is None
    after = scrape_metrics(server.metrics)
    for name in ("vllm:request_params_n_count", "vllm:request_params_n_sum"):
        assert metric(after, name, "llm") - metric(before, name, "llm") == {
            "vllm:request_params_n_count": 3, "vllm:request_params_n_sum": 6}[name]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("logprobs", [None, 0, 2])
@pytest.mark.parametrize("switch", [None, True, False])
def test_additional_outputs(server, stream, logprobs, switch):
    """Mirrors L0_additional_outputs_vllm test_additional_outputs (every return_* switch
    set alike; its rules): an output only when its switch is true; finish_reason "None"
    until the final "length"; cumulative_logprob changing with each response; logprobs
    null without a "logprobs" sampling parameter (the sampled token's was sent), else one
    dict per output token of at most logprobs + 1 entries with one rank-1 token, whose
    decoded tokens spell the text (the prompt first when not streamed)."""
    sampling = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    names = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs",
             "return_num_input_tokens", "return_num_output_tokens")
    flags = {} if switch is None else {name: switch for name in names}
    outcome = infer_one(server.grpc, "llm_default", llm_inputs(ENGLISH, sampling, stream=stream, **flags))
    assert outcome.error is None and outcome.responses
    assert outcome.text.count(" ") > 4, outcome.text  # a sentence
    if not switch:
        for name in ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                     "num_output_tokens"):
            assert all(name not in r for r in outcome.responses), name
        return
    reasons = [r["finish_reason"][0].decode() for r in outcome.responses]
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {"None"}
    cumulative = [float(r["cumulative_logprob"][0]) for r in outcome.responses]
    assert all(a != b for a, b in zip([0.0] + cumulative, cumulative))
    for r in outcome.responses:
        assert 0 < int(r["num_input_tokens"][0]) <= len(ENGLISH)
        assert int(r["num_output_tokens"][0]) > 0
        parsed = json.loads(r["logprobs"][0])
        if logprobs is None:
            assert parsed is None
            continue
        assert len(parsed) == int(r["num_output_tokens"][0])
        spelled = ""
        for position in parsed:
            assert 1 <= len(position) <= logprobs + 1
            ranked_first = [e for e in position.values() if e["rank"] == 1]
            assert len(ranked_first) == 1
            assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in position.values())
            spelled += ranked_first[0]["decoded_token"]
        text = r["text_output"][0].decode()
        assert (spelled if stream else ENGLISH + spelled) == text


def test_vllm_is_healthy(server):
    """Mirrors L0_check_health_vllm test_vllm_is_healthy: ready, three requests answered,
    still ready. (test_vllm_not_healthy's text: tests/backend/test_engine_loop.py; the
    unload after a dead engine: test_llm_overload.py.)"""
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        for _ in range(3):
            assert client.is_model_ready("llm")
            outcome = infer_one(server.grpc, "llm_default", llm_inputs(ENGLISH, {"max_tokens": 8,
                                                                                "temperature": 0}))
            assert outcome.error is None and outcome.text.startswith(ENGLISH)
        assert client.is_model_ready("llm")
    finally:
        client.close()


def test_lora_name_on_a_model_without_lora_gets_vllm_backends_error(server):
    """Mirrors L0_multi_gpu_vllm/multi_lora's case without enable_lora (message compared
    whole); the unknown-name text: tests/backend/test_multi_lora.py."""
    outcome = infer_one(server.grpc, "llm", llm_inputs(ENGLISH, {"max_tokens": 4, "lora_name": "doll"}))
    assert outcome.error == "LoRA feature is not enabled."


@pytest.mark.parametrize("case", ["grpc", "http generate"])
def test_lone_surrogates_are_invalid_arg(server, case):
    """JSON's \\ud800 escape (a lone surrogate, not text) in sampling_parameters is the
    client's error, named, and the model serves on. (A lone surrogate escaped in HTTP
    generate's body itself never reaches the model: Triton's JSON parser refuses it.)"""
    sampling = '{"max_tokens": 2, "stop": ["\\ud800"]}'
    if case == "grpc":
        tensors = llm_inputs("hi")
        tensors["sampling_parameters"] = np.array([sampling.encode()], dtype=np.object_)
        outcome = infer_one(server.grpc, "llm", tensors)
        assert outcome.error is not None and "stop[0] holds a lone surrogate" in outcome.error
    else:
        answer = requests.post(f"{server.http}/v2/models/llm/generate", timeout=60,
                               json={"text_input": "hi", "sampling_parameters": sampling})
        assert answer.status_code == 400, answer.text
        assert "stop[0] holds a lone surrogate" in answer.text, answer.text
    after = infer_one(server.grpc, "llm", llm_inputs("hi", {"max_tokens": 2}))
    assert after.error is None


def test_parameters_sent_as_request_parameters(server):
    """Mirrors L0_backend_vllm/vllm_backend test_vllm_triton_backend's
    send_parameters_as_tensor=False: sampling in Triton's request parameters (strings)."""
    client = grpcclient.InferenceServerClient(server.grpc)
    answers: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        tensors = llm_inputs(ENGLISH, exclude_input_in_output=True)
        tensors.pop("stream")
        client.async_stream_infer("llm", tensors_to_inputs(tensors), request_id="7",
                                  parameters={"temperature": "0", "top_p": "1", "max_tokens": "6"})
        answer = answers.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    assert not isinstance(answer, InferenceServerException), answer
    alone = infer_one(server.grpc, "llm", llm_inputs(ENGLISH, {"temperature": 0, "max_tokens": 6},
                                                     exclude_input_in_output=True))
    assert answer.as_numpy("text_output")[0].decode() == alone.text
    assert np.asarray(answer.as_numpy("text_output")).shape == (1,)
