"""Issue 43 on the real server: `python -m openai_frontend` in front of the session's
tritonserver, attacked as a careless client would. A non-streaming request whose client
leaves, and a stream nobody reads, leave Triton's RUNNING requests and KV cache (read on
Triton's own metrics port); a batch past --max-sequences-per-request and an 8 MB body
are refused; /tokenize needs the key; lone surrogates are a 400; SIGTERM with requests in
flight returns. Route-level details with a stand-in Triton: tests/openai_frontend/test_route_guards.py."""
from __future__ import annotations

import signal
import time

import pytest
import requests

from bench.attack_route import raw_post
from tests.e2e.test_openai_frontend import SERVED, start_frontend, stop_frontend
from tests.e2e.triton_clients import scrape_metrics

pytestmark = pytest.mark.slow

KEY = "guard-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Long enough that none of these finishes while a test watches it: 16 sequences to
# the end would be 7,680 tokens (and more than the tiny model's 4,096-token KV pool).
LONG = {"model": SERVED, "prompt": "Hello", "n": 16, "max_tokens": 480, "min_tokens": 480,
        "temperature": 1.0}
# A chat stream whose events are big (20 top logprobs with their bytes for each of 16
# sequences), so the socket buffers fill long before its 16 x 440 tokens are out.
BIG_STREAM = {"model": SERVED, "messages": [{"role": "user", "content": "Hello"}], "n": 16,
              "max_tokens": 440, "min_tokens": 440, "temperature": 1.0, "stream": True,
              "logprobs": True, "top_logprobs": 20}


def llm_metric(server, name):
    # Triton adds an `instance` label, so the labels are matched one by one.
    return sum(v for k, v in scrape_metrics(server.metrics).items()
               if k.startswith(name + "{") and 'model="llm"' in k)


def eventually(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def idle(server):
    return llm_metric(server, "vllm:num_requests_running") == 0 \
        and llm_metric(server, "vllm:num_requests_waiting") == 0


def send_raw(url, path, body, rcvbuf=None):
    """A socket that has sent the request and reads nothing."""
    return raw_post(url, path, body, rcvbuf, key=KEY)


def route_cancelled(url, reason):
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'openai_frontend:requests_cancelled_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no openai_frontend:requests_cancelled_total{{reason={reason!r}}}")


@pytest.fixture(scope="module")
def guarded(server):
    process, url = start_frontend(server, "--api-key", KEY, "--stream-idle-timeout", "1")
    try:
        yield url
    finally:
        stop_frontend(process)


def test_a_client_that_leaves_a_whole_answer_frees_its_sequences(server, guarded):
    eventually(lambda: idle(server), "Triton busy before the test")
    baseline_kv = llm_metric(server, "vllm:kv_cache_usage_perc")
    before = llm_metric(server, "vllm:generation_tokens_total")
    sock = send_raw(guarded, "/v1/completions", LONG)
    eventually(lambda: llm_metric(server, "vllm:num_requests_running") > 0, "never ran")
    sock.close()
    eventually(lambda: idle(server), "the request kept running after its client left")
    eventually(lambda: llm_metric(server, "vllm:kv_cache_usage_perc") <= baseline_kv,
               "KV cache not freed")
    assert llm_metric(server, "vllm:generation_tokens_total") - before < 16 * 480 / 2
    assert route_cancelled(guarded, "client_disconnected") >= 1


def test_a_stream_nobody_reads_is_cancelled_after_the_idle_timeout(server, guarded):
    eventually(lambda: idle(server), "Triton busy before the test")
    before = llm_metric(server, "vllm:generation_tokens_total")
    sock = send_raw(guarded, "/v1/chat/completions", BIG_STREAM, rcvbuf=4096)
    try:
        eventually(lambda: route_cancelled(guarded, "stream_not_read") == 1,
                   "a stream nobody reads was not cancelled", timeout=60)
        eventually(lambda: idle(server), "the unread stream kept running on Triton")
    finally:
        sock.close()
    # Cancelled before the end (the socket buffers hold a few MB of events).
    assert llm_metric(server, "vllm:generation_tokens_total") - before < 16 * 440


def test_requests_past_the_limits_are_refused(server, guarded):
    r = requests.post(f"{guarded}/v1/completions", headers=AUTH, timeout=30,
                      json={"model": SERVED, "prompt": [f"prompt {i}" for i in range(1000)],
                            "n": 2, "max_tokens": 1500})
    assert r.status_code == 400 and "--max-sequences-per-request" in r.json()["error"]["message"]
    r = requests.post(f"{guarded}/tokenize", headers=AUTH, timeout=60,
                      json={"model": SERVED, "prompt": "hello " * (8_000_000 // 6)})
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    assert requests.get(f"{guarded}/health", timeout=10).status_code == 200
    r = requests.post(f"{guarded}/tokenize", json={"model": SERVED, "prompt": "hi"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert requests.post(f"{guarded}/tokenize", json={"model": SERVED, "prompt": "hi"},
                         headers=AUTH, timeout=10).status_code == 200
    assert idle(server)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": SERVED, "prompt": "a\ud800", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": SERVED, "max_tokens": 2,
                              "messages": [{"role": "user", "content": "\udc00 hi"}]}),
    ("/tokenize", {"model": SERVED, "prompt": "\ud800"}),
])
def test_lone_surrogates_are_a_400(guarded, path, body):
    r = requests.post(f"{guarded}{path}", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]


def test_sigterm_with_requests_in_flight_returns_and_cancels_them(server):
    process, url = start_frontend(server, "--graceful-shutdown-timeout", "1",
                                  "--stream-idle-timeout", "0")
    sockets = []
    try:
        eventually(lambda: idle(server), "Triton busy before the test")
        sockets.append(send_raw(url, "/v1/completions", LONG))
        # A stream nobody reads: a route that waits for it to end never exits.
        sockets.append(send_raw(url, "/v1/chat/completions", BIG_STREAM, rcvbuf=4096))
        eventually(lambda: llm_metric(server, "vllm:num_requests_running") >= 2, "never ran")
        process.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once it has shut down: the exit is SIGTERM's.
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
        eventually(lambda: idle(server), "requests kept running after the route exited")
    finally:
        for sock in sockets:
            sock.close()
        if process.poll() is None:
            stop_frontend(process)
