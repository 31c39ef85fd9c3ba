"""schemathesis against the running OpenAI route (`python -m openai_frontend --api-key`
in front of the session's real tritonserver): every operation of FastAPI's OpenAPI
document, with generated bodies, paths and queries. No response is a 500, every error is
an OpenAI error object, and the route and Triton are still healthy afterwards.

Half the generated bodies name the served model with a plain prompt, so generation
really runs on Triton;
max_tokens and n are capped there only to bound the time (the refusals of big values are
the parsers' fuzz tests' business: tests/backend/test_request_parsing_fuzz.py)."""
from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest
import requests
from hypothesis import HealthCheck, given, settings

from tests.e2e.test_openai_frontend import SERVED, start_frontend, stop_frontend

schemathesis = pytest.importorskip(
    "schemathesis", reason="schemathesis is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.slow

API_KEY = "fuzz-api-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Per operation (9 of them); a case takes ~0.05-0.5 s.
MAX_EXAMPLES = 15
TIME_CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "top_logprobs": 2,
             "logprobs": 2}


@pytest.fixture(scope="module")
def fuzzed_route(server):
    process, url = start_frontend(server, "--api-key", API_KEY)
    try:
        yield url
    finally:
        # Still healthy after every case, Triton's model included (/health asks it).
        healthy = requests.get(f"{url}/health", timeout=10).status_code
        alive = process.poll() is None
        stop_frontend(process)
        assert alive and healthy == 200, "the route or Triton did not survive the fuzzing"


@pytest.fixture(scope="module")
def route_schema(fuzzed_route):
    return schemathesis.openapi.from_url(f"{fuzzed_route}/openapi.json")


def steered(body):
    """Half the bodies (chosen by their hash, so a failing case replays) name the served
    model; every body gets its time caps."""
    if not isinstance(body, dict):
        return body
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).digest()
    if "model" in body and digest[0] % 2:
        body["model"] = SERVED
        # and a well-formed prompt, so that the other fields decide what happens
        if "prompt" in body:
            body["prompt"] = "Hello"
        if "messages" in body:
            body["messages"] = [{"role": "user", "content": "Hi"}]
    for name, cap in TIME_CAPS.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    return body


def assert_openai_error(response) -> None:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        pytest.fail(f"{response.status_code} is not an OpenAI error object: {response.text[:300]}")
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error


def check_case(case, statuses: Counter) -> None:
    case.body = steered(case.body)
    response = case.call(headers=AUTH, timeout=120)
    statuses[case.operation.label, response.status_code] += 1
    # 503 is Triton refusing for load (busy), never the route failing.
    assert response.status_code < 500 or response.status_code == 503, (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}")
    if response.status_code >= 400:
        assert_openai_error(response)
    elif "text/event-stream" in str(response.headers.get("content-type")):
        # A stream that failed after it started ends with an error event, never a 500's.
        for line in response.text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    assert event["error"].get("code") != "internal_error", line


def test_every_operation_no_500_and_every_error_is_an_openai_error(route_schema):
    # schemathesis' own pytest integration (from_fixture) fails under pytest 9 ("'Function'
    # object has no attribute '_nodeid'"), so each operation's strategy is run here.
    operations = [result.ok() for result in route_schema.get_all_operations()]
    labels = {operation.label for operation in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
            "GET /metrics", "GET /health"} <= labels, labels
    statuses: Counter = Counter()
    for operation in operations:
        # derandomize: the same cases every run, so a CI failure replays here.
        fuzz = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                        derandomize=True, suppress_health_check=list(HealthCheck))(
            given(case=operation.as_strategy())(lambda case: check_case(case, statuses)))
        fuzz()
    print(sorted(statuses.items()))
    # Not only refusals: some generated requests ran on Triton.
    assert statuses["POST /v1/completions", 200] + statuses["POST /v1/chat/completions", 200]


def test_without_the_key_every_v1_operation_is_a_401_openai_error(fuzzed_route):
    for method, path in (("get", "/v1/models"), ("get", f"/v1/models/{SERVED}"),
                         ("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                         # stricter than vLLM: the tokenizer routes need the key too
                         ("post", "/tokenize"), ("post", "/detokenize")):
        response = getattr(requests, method)(f"{fuzzed_route}{path}", timeout=10, json={})
        assert response.status_code == 401, (path, response.text)
        assert_openai_error(response)
        assert response.json()["error"]["code"] == "invalid_api_key"
