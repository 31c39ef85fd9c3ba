"""The OpenAI service's HTTP behaviour with no Triton behind it (its gRPC address is a
closed port): health says 503, requests get OpenAI error objects with the right status,
and the service keeps answering. The real-server path is tests/e2e/test_openai_frontend.py."""
from __future__ import annotations

import threading
import time

import pytest
import requests

from backend.triton_server import free_port
from openai_frontend.__main__ import DEFAULT_PORT, parse_args

uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install -e '.[serve]')")


@pytest.fixture(scope="module")
def service():
    from openai_frontend.app import create_app
    from openai_frontend.chat import load_tokenizer

    nobody = f"127.0.0.1:{free_port()}"
    app = create_app(nobody, "llm", "served", load_tokenizer(None))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "service did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def error_of(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_health_is_503_while_triton_is_unreachable(service):
    error = error_of(requests.get(f"{service}/health", timeout=10), 503)
    assert "not ready" in error["message"]


def test_models_lists_the_served_name(service):
    body = requests.get(f"{service}/v1/models", timeout=10).json()
    assert [m["id"] for m in body["data"]] == ["served"] and body["object"] == "list"
    assert requests.get(f"{service}/v1/models/served", timeout=10).json()["id"] == "served"
    assert error_of(requests.get(f"{service}/v1/models/other", timeout=10), 404)["code"] == "model_not_found"


def test_requests_when_triton_is_down_are_503(service):
    for stream in (False, True):
        r = requests.post(f"{service}/v1/chat/completions", timeout=20, json={
            "model": "served", "messages": [{"role": "user", "content": "Hi"}], "stream": stream})
        assert error_of(r, 503)["type"] == "service_unavailable_error"


@pytest.mark.parametrize("route,body,status,param", [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": "served", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    # Unknown fields are ignored: a bad value of a known field is still a 400.
    ("/v1/completions", {"model": "served", "prompt": "x", "frobnicate": 1, "n": "two"}, 400, "n"),
    ("/v1/completions", {"model": "served"}, 400, "prompt"),
    # Token-id prompts are taken (they reach Triton: 503 here); these forms never do.
    *(("/v1/completions", {"model": "served", "prompt": prompt}, 400, "prompt")
      for prompt in ([1, "a"], ["a", 1], [[1], "a"], [[1, 2], [3, "4"]], [], [[]], [-1],
                     [[5], [-2]], [True, 2], [1.0, 2], {"a": 1})),
    ("/v1/chat/completions", {"model": "served", "messages": [{"role": "x", "content": "y"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "served", "messages": [], "n": 2}, 400, "messages"),
])
def test_bad_requests_get_openai_errors(service, route, body, status, param):
    assert error_of(requests.post(f"{service}{route}", json=body, timeout=10), status)["param"] == param


def test_malformed_json_and_unknown_routes(service):
    r = requests.post(f"{service}/v1/completions", data=b"{oops", timeout=10,
                      headers={"Content-Type": "application/json"})
    assert "not valid JSON" in error_of(r, 400)["message"]
    error_of(requests.get(f"{service}/v1/nothing", timeout=10), 404)
    error_of(requests.get(f"{service}/v1/completions", timeout=10), 405)


def test_cli_defaults_match_the_sidecar_command():
    args = parse_args([])
    assert (args.triton_grpc, args.model, args.host, args.port) == ("localhost:8001", "llm", "0.0.0.0", 9000)
    assert DEFAULT_PORT == 9000 and args.tokenizer is None and args.served_model_name is None
    args = parse_args(["--served-model-name", "smol", "--port", "9100"])
    assert (args.served_model_name, args.port) == ("smol", 9100)
