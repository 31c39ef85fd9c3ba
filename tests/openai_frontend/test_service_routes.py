"""The route's service endpoints over HTTP, with no Triton behind it: --api-key (401 as
an OpenAI error; /v1 guarded as in vLLM, and /tokenize /detokenize /tokenizer_info too),
/tokenize /detokenize /tokenizer_info /version in vLLM's shapes, /metrics passing Triton's text through, unknown fields ignored, tools accepted.
Triton's metrics endpoint is stood in for by a local HTTP server serving fixed text."""
from __future__ import annotations

import http.server
import threading
import time

import pytest
import requests

from backend.triton_server import free_port
from openai_frontend.__main__ import frontend_options, parse_args
from openai_frontend.chat import load_tokenizer, render_chat
from openai_frontend.options import FrontendOptions

uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install -e '.[serve]')")
openai = pytest.importorskip("openai")

KEYS = ("key-one", "key-two")
METRICS = ('# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n'
           'vllm:num_requests_running{model="llm",version="1"} 0\n')
USER = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


class _FakeTritonMetrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = METRICS.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _serve(app):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "service did not start"
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def service(tokenizer):
    from openai_frontend.app import create_app

    metrics = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeTritonMetrics)
    threading.Thread(target=metrics.serve_forever, daemon=True).start()
    options = FrontendOptions(api_keys=KEYS, max_model_len=2048, tokenizer_info=True,
                              triton_metrics_url=f"http://127.0.0.1:{metrics.server_port}/metrics")
    server, thread, url = _serve(create_app(f"127.0.0.1:{free_port()}", "llm", "served", tokenizer,
                                            options))
    yield url
    server.should_exit = True
    thread.join(timeout=10)
    metrics.shutdown()


def auth(key=KEYS[1]):
    return {"Authorization": f"Bearer {key}"}


def test_v1_needs_one_of_the_keys(service):
    for headers in ({}, auth("wrong"), {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": KEYS[0]}):
        r = requests.get(f"{service}/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401, headers
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
        assert error["type"] == "invalid_request_error"
    r = requests.post(f"{service}/v1/chat/completions", json={"model": "served", "messages": USER}, timeout=10)
    assert r.status_code == 401
    for key in KEYS:
        assert requests.get(f"{service}/v1/models", headers=auth(key), timeout=10).status_code == 200
    assert requests.options(f"{service}/v1/models", timeout=10).status_code != 401
    # The official client raises its AuthenticationError on our 401.
    with pytest.raises(openai.AuthenticationError) as error:
        openai.OpenAI(base_url=f"{service}/v1", api_key="wrong", max_retries=0).models.list()
    assert error.value.code == "invalid_api_key"
    client = openai.OpenAI(base_url=f"{service}/v1", api_key=KEYS[0], max_retries=0)
    assert [m.id for m in client.models.list().data] == ["served"]


def test_health_version_metrics_stay_open_tokenize_needs_the_key(service):
    assert requests.get(f"{service}/version", timeout=10).json() == {"version": "0.1.0"}
    assert requests.get(f"{service}/openapi.json", timeout=10).status_code == 200
    # vLLM takes the scheme in any case, as RFC 7235 has it.
    headers = {"Authorization": f"bearer {KEYS[0]}"}
    assert requests.get(f"{service}/v1/models", headers=headers, timeout=10).status_code == 200
    assert requests.get(f"{service}/health", timeout=10).status_code == 503  # Triton is down
    assert requests.get(f"{service}/metrics", timeout=10).status_code == 200
    # Stricter than vLLM: the tokenizer runs on what a client sends.
    for route, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        r = requests.post(f"{service}{route}", json=body, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert requests.post(f"{service}{route}", json=body, headers=auth(), timeout=10).status_code == 200


def test_prompt_tokens_details_is_on_and_tokenizer_info_off_by_default():
    defaults = frontend_options(parse_args([]), {})
    assert defaults.prompt_tokens_details and not defaults.tokenizer_info
    flipped = frontend_options(parse_args(["--no-enable-prompt-tokens-details",
                                           "--enable-tokenizer-info-endpoint"]), {})
    assert not flipped.prompt_tokens_details and flipped.tokenizer_info
    assert frontend_options(parse_args(["--enable-prompt-tokens-details"]), {}).prompt_tokens_details


def test_api_key_flag_wins_over_the_env_var():
    assert frontend_options(parse_args([]), {}).api_keys == ()
    assert frontend_options(parse_args([]), {"VLLM_API_KEY": "env"}).api_keys == ("env",)
    assert frontend_options(parse_args(["--api-key", "a", "b"]), {"VLLM_API_KEY": "env"}).api_keys == ("a", "b")
    args = parse_args(["--tool-call-parser", "pythonic", "--enable-auto-tool-choice"])
    assert frontend_options(args, {}).tool_calls.enable_auto_tool_choice
    with pytest.raises(SystemExit):
        parse_args(["--enable-auto-tool-choice"])
    with pytest.raises(SystemExit):
        parse_args(["--tool-call-parser", "nonesuch"])


def test_metrics_are_tritons_text_then_the_routes_counters(service):
    r = requests.get(f"{service}/metrics", timeout=10)
    assert r.status_code == 200 and r.text.startswith(METRICS)
    assert 'openai_frontend:requests_cancelled_total{reason="stream_not_read"} 0' in r.text
    assert r.headers["content-type"].startswith("text/plain")


def test_tokenize_a_prompt_and_a_chat(service, tokenizer):
    r = requests.post(f"{service}/tokenize", headers=auth(), json={"prompt": "Hello world", "return_token_strs": True},
                      timeout=10).json()
    ids = tokenizer("Hello world")["input_ids"]
    assert r == {"count": len(ids), "max_model_len": 2048, "tokens": ids,
                 "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    r = requests.post(f"{service}/tokenize", headers=auth(), json={"model": "served", "messages": USER,
                                                   "unknown_field": 1}, timeout=10).json()
    prompt = render_chat(tokenizer, USER)
    assert r["tokens"] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert r["token_strs"] is None and r["count"] == len(r["tokens"])
    r = requests.post(f"{service}/tokenize", headers=auth(), json={"model": "other", "prompt": "x"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert requests.post(f"{service}/tokenize", headers=auth(), json={"prompt": 5}, timeout=10).status_code == 400


def test_tokenizer_info_needs_the_key_and_has_vllms_shape(service, tokenizer):
    """vLLM's fields (tokenizer_config.json as transformers read it, tokenizer_class,
    chat_template); its real output is compared in tests/e2e/test_token_prompts.py."""
    assert requests.get(f"{service}/tokenizer_info", timeout=10).status_code == 401
    info = requests.get(f"{service}/tokenizer_info", headers=auth(), timeout=10).json()
    assert info["tokenizer_class"] == type(tokenizer).__name__ == "LlamaTokenizerFast"
    assert info["chat_template"] == tokenizer.chat_template
    assert info["bos_token"] == tokenizer.bos_token and info["eos_token"] == tokenizer.eos_token
    assert info["model_max_length"] == tokenizer.model_max_length
    # No path of this host.
    assert not {"vocab_file", "merges_file", "tokenizer_file", "name_or_path"} & set(info)


def test_detokenize(service, tokenizer):
    ids = tokenizer("Bonjour, le monde")["input_ids"]
    r = requests.post(f"{service}/detokenize", headers=auth(), json={"tokens": ids}, timeout=10)
    assert r.json() == {"prompt": tokenizer.decode(ids)}
    r = requests.post(f"{service}/detokenize", headers=auth(), json={"tokens": [len(tokenizer) + 5]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("extra", [{"frobnicate": 1}, {"tools": TOOLS, "tool_choice": "required"},
                                   {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}])
def test_unknown_fields_and_tools_reach_triton(service, extra):
    # 503 is Triton being down: the request passed validation (it was 400 before).
    r = requests.post(f"{service}/v1/chat/completions", headers=auth(), timeout=20,
                      json={"model": "served", "messages": USER, **extra})
    assert r.status_code == 503, r.text


def test_auto_tool_choice_without_the_flags_is_refused(service):
    r = requests.post(f"{service}/v1/chat/completions", headers=auth(), timeout=20,
                      json={"model": "served", "messages": USER, "tools": TOOLS})
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]


def test_metrics_when_triton_is_unreachable_is_503_and_the_service_stays_up(tokenizer):
    from openai_frontend.app import create_app

    options = FrontendOptions(triton_metrics_url=f"http://127.0.0.1:{free_port()}/metrics")
    server, thread, url = _serve(create_app(f"127.0.0.1:{free_port()}", "llm", "served", tokenizer,
                                            options))
    try:
        r = requests.get(f"{url}/metrics", timeout=20)
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        # No --api-key: /v1 is open.
        assert requests.get(f"{url}/v1/models", timeout=10).status_code == 200
        # As in vLLM, /tokenizer_info is served only with --enable-tokenizer-info-endpoint.
        assert requests.get(f"{url}/tokenizer_info", timeout=10).status_code == 404
    finally:
        server.should_exit = True
        thread.join(timeout=10)
