"""Issue 43, the route guarding itself, over real HTTP with a stand-in for Triton (a fake
`TritonLLM` that never finishes a request and records the ones it was made to cancel):
a client that leaves has its requests cancelled, a stream nobody reads is cancelled,
bodies are bounded (413), batches are bounded (400), lone surrogates are a 400, the
tokenizer runs off the event loop, and the server caps connections and slow heads.
The real-server checks are tests/e2e/test_openai_guards.py."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from backend.triton_server import free_port
from openai_frontend.options import FrontendOptions
from openai_frontend.triton_client import Chunk

uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install -e '.[serve]')")

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "Hi"}]


class FakeLLM:
    """Streams big chunks without end, or never answers a non-streaming request."""
    instances: list["FakeLLM"] = []

    def __init__(self, *args, **kwargs) -> None:
        self.started = 0
        self.cancelled = 0
        self.lock = threading.Lock()
        FakeLLM.instances.append(self)

    async def close(self) -> None:
        pass

    async def ready(self) -> bool:
        return True

    async def model_parameter(self, name):
        return None

    async def generate(self, prompt, sampling, stream, logprobs):
        n = int(sampling.get("n", 1))
        if prompt == "busy":  # as the backend refuses when its queue is full
            from tritonclient.utils import InferenceServerException

            from openai_frontend.errors import from_triton

            raise from_triton(InferenceServerException(
                msg="server busy: 1024 sequences already queued, this request needs 1 "
                    "(MAX_QUEUE_LEN=1024); retry later"))
        with self.lock:
            self.started += 1
        try:
            if not stream:
                await asyncio.Event().wait()
            while True:
                yield Chunk(["x" * 4096] * n, [None] * n, 1, [1] * n, None, False)
                await asyncio.sleep(0)
        finally:
            with self.lock:
                self.cancelled += 1


def eventually(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture(scope="module")
def tokenizer():
    from openai_frontend.chat import load_tokenizer

    return load_tokenizer(None)


def start(app, limits=None):
    from openai_frontend.server import ServerLimits, server_config

    port = free_port()
    config = server_config(app, "127.0.0.1", port, "warning", limits or ServerLimits(),
                           lambda: None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    eventually(lambda: server.started, "service did not start")
    return server, thread, port


@pytest.fixture(scope="module")
def guarded(tokenizer):
    """(url, port, fake llm, app) with a short stream idle timeout and a small body limit."""
    from openai_frontend import app as app_module

    patch = pytest.MonkeyPatch()
    patch.setattr(app_module, "TritonLLM", FakeLLM)
    options = FrontendOptions(api_keys=(KEY,), max_model_len=2048, stream_idle_timeout=0.5,
                              max_request_bytes=64 * 1024, max_sequences_per_request=64)
    app = app_module.create_app("unused:1", "llm", "served", tokenizer, options)
    server, thread, port = start(app)
    yield f"http://127.0.0.1:{port}", port, FakeLLM.instances[-1], app
    server.should_exit = True
    thread.join(timeout=10)
    patch.undo()


def raw_request(port, path, body, rcvbuf=None):
    """A socket that has sent a POST and reads nothing."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                 + data)
    return sock


def cancelled_metric(url, reason):
    text = requests.get(f"{url}/metrics", timeout=10).text
    line = next(l for l in text.splitlines()
                if l.startswith(f'openai_frontend:requests_cancelled_total{{reason="{reason}"}}'))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("path,body,sequences", [
    ("/v1/completions", {"model": "served", "prompt": "x", "n": 16}, 1),
    ("/v1/completions", {"model": "served", "prompt": ["a", "b", "c"], "n": 2}, 3),
    ("/v1/chat/completions", {"model": "served", "messages": USER, "n": 4}, 1),
])
def test_a_client_that_leaves_a_whole_answer_cancels_its_triton_requests(guarded, path, body,
                                                                        sequences):
    url, port, llm, _ = guarded
    before_started, before_cancelled = llm.started, llm.cancelled
    before_metric = cancelled_metric(url, "client_disconnected")
    sock = raw_request(port, path, body)
    eventually(lambda: llm.started == before_started + sequences, "Triton requests not sent")
    assert llm.cancelled == before_cancelled
    sock.close()
    eventually(lambda: llm.cancelled == before_cancelled + sequences,
               "the Triton requests of a client that left were not cancelled")
    assert cancelled_metric(url, "client_disconnected") == before_metric + 1


def test_a_stream_nobody_reads_is_cancelled_and_counted(guarded):
    url, port, llm, _ = guarded
    before_cancelled = llm.cancelled
    before = cancelled_metric(url, "stream_not_read")
    sock = raw_request(port, "/v1/completions",
                       {"model": "served", "prompt": "x", "n": 4, "stream": True}, rcvbuf=4096)
    try:
        eventually(lambda: llm.cancelled == before_cancelled + 1,
                   "a stream nobody reads was not cancelled")
        assert cancelled_metric(url, "stream_not_read") == before + 1
    finally:
        sock.close()
    # A stream that is read goes on past the idle timeout.
    with requests.post(f"{url}/v1/completions", headers=AUTH, stream=True, timeout=30,
                       json={"model": "served", "prompt": "x", "stream": True}) as r:
        assert r.status_code == 200
        read = 0
        for chunk in r.iter_content(65536):
            read += len(chunk)
            if read > 4096 * 400:
                break
    assert cancelled_metric(url, "stream_not_read") == before + 1


def test_bodies_over_the_limit_are_413_and_the_route_stays_up(guarded):
    url, _, _, _ = guarded
    big = {"model": "served", "prompt": "x" * (100 * 1024)}
    for path in ("/v1/completions", "/tokenize", "/v1/chat/completions"):
        r = requests.post(f"{url}{path}", json=big, headers=AUTH, timeout=30)
        assert r.status_code == 413, r.text
        assert "--max-request-bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: counted as it comes
        yield b'{"model": "served", "prompt": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    r = requests.post(f"{url}/tokenize", data=chunked(), timeout=30,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    r = requests.post(f"{url}/tokenize", json={"prompt": "fits"}, headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json()["count"] > 0


def test_default_limit_refuses_an_8_mb_tokenize(tokenizer):
    from openai_frontend.app import create_app

    server, thread, port = start(create_app(f"127.0.0.1:{free_port()}", "llm", "served", tokenizer,
                                            FrontendOptions(max_model_len=2048)))
    try:
        r = requests.post(f"http://127.0.0.1:{port}/tokenize", timeout=60,
                          json={"prompt": "hello " * (8_000_000 // 6)})
        assert r.status_code == 413 and str(4 * 1024 * 1024) in r.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_batch_past_the_sequence_limit_is_refused_naming_the_flag(guarded):
    url, _, llm, _ = guarded
    started = llm.started
    r = requests.post(f"{url}/v1/completions", headers=AUTH, timeout=10,
                      json={"model": "served", "prompt": ["p"] * 1000, "n": 2})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "--max-sequences-per-request" in error["message"] and "2000" in error["message"]
    r = requests.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=10,
                      json={"model": "served", "messages": USER, "n": 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert llm.started == started


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": "served", "prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"model": "served", "prompt": ["ok", "\udfff"]}, "prompt"),
    ("/v1/completions", {"model": "served", "prompt": "x", "stop": ["\ud800"]}, "stop"),
    ("/v1/chat/completions", {"model": "served", "messages": [{"role": "user", "content": "\ud800"}]},
     "messages"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
])
def test_lone_surrogates_are_a_400(guarded, path, body, param):
    url, _, llm, _ = guarded
    started = llm.started
    # json.dumps writes the lone surrogate as the escape \ud800, as a client's JSON would.
    r = requests.post(f"{url}{path}", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"]
    assert llm.started == started
    # A proper pair (an emoji) is fine.
    r = requests.post(f"{url}/tokenize", json={"prompt": "\ud83d\ude00"}, headers=AUTH, timeout=10)
    assert r.status_code == 200


class _BlockingTokenizer:
    """The real tokenizer, whose encoding waits for `release`."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        assert self.release.wait(60)
        return self._inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_tokenizing_does_not_hold_the_event_loop(tokenizer):
    from openai_frontend.app import create_app

    slow = _BlockingTokenizer(tokenizer)
    server, thread, port = start(create_app(f"127.0.0.1:{free_port()}", "llm", "served", slow,
                                            FrontendOptions(max_model_len=2048)))
    url = f"http://127.0.0.1:{port}"
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(requests.post, f"{url}/tokenize", json={"prompt": "hi"},
                                  timeout=60)
            assert slow.entered.wait(30)
            # Answered while the tokenizer is busy: the loop is free.
            assert requests.get(f"{url}/v1/models", timeout=10).status_code == 200
            slow.release.set()
            assert pending.result().status_code == 200
    finally:
        slow.release.set()
        server.should_exit = True
        thread.join(timeout=10)


def test_connections_past_the_cap_get_503_and_slow_heads_are_closed(tokenizer):
    from openai_frontend.app import create_app
    from openai_frontend.server import ServerLimits, server_config

    refused = []
    app = create_app(f"127.0.0.1:{free_port()}", "llm", "served", tokenizer,
                     FrontendOptions(max_model_len=2048))
    port = free_port()
    config = server_config(app, "127.0.0.1", port, "warning",
                           ServerLimits(max_connections=3, header_timeout=0.5),
                           lambda: refused.append(1))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    eventually(lambda: server.started, "service did not start")
    held = []
    try:
        for _ in range(3):  # heads that never end
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
            held.append(sock)
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(30)
        answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections" in answer
        assert refused == [1]
        for sock in held:  # closed for not finishing the head
            sock.settimeout(30)
            assert sock.recv(4096) == b""
        # Room again: a whole request is served.
        assert requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
    finally:
        for sock in held:
            sock.close()
        server.should_exit = True
        thread.join(timeout=10)


def test_repeated_warnings_are_bounded():
    from openai_frontend.server import RepeatFilter

    now = [0.0]
    repeat = RepeatFilter(burst=5, window=60, clock=lambda: now[0])
    record = lambda msg="accept failed: %s", level=logging.ERROR: logging.LogRecord(  # noqa: E731
        "asyncio", level, __file__, 1, msg, ("EMFILE",), None)
    assert sum(repeat.filter(record()) for _ in range(1000)) == 5
    assert repeat.filter(record("another kind"))
    assert all(repeat.filter(record(level=logging.INFO)) for _ in range(100))
    now[0] = 61
    late = record()
    assert repeat.filter(late) and "995 more like this dropped" in late.getMessage()


def test_a_full_triton_queue_is_a_503_for_openai_clients(guarded):
    url, _, _, _ = guarded
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30)
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as busy:
            client.completions.create(model="served", prompt="busy", stream=stream)
        assert busy.value.status_code == 503 and "server busy" in busy.value.message
    r = requests.post(f"{url}/v1/completions", headers=AUTH, timeout=30,
                      json={"model": "served", "prompt": ["x", "busy"], "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
