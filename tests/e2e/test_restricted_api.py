"""scripts/serve.py --restrict-api-file on the real tritonserver: without the admin-key
header the model-repository and model-config APIs are refused on HTTP and gRPC, with it
they work (unload `llm`), and inference, health and metadata stay open. The
OpenAI frontend's model-config call sends the header (--triton-admin-key)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import requests

from backend.repository_layout import copy_repository
from backend.restricted_api import grpc_headers, http_headers
from backend.triton_server import REPO_ROOT, ServerPorts
from tests.e2e.shared import TINY_ENGINE_ARGS
from tests.e2e.triton_clients import infer_one, llm_inputs

pytestmark = pytest.mark.slow

KEY = "e2e-admin-key-0123456789abcdef"
ADMIN = http_headers(KEY)
GRPC_ADMIN = grpc_headers(KEY)


@pytest.fixture(scope="module")
def restricted(tmp_path_factory, tiny_model_dir):
    """serve.py on a repository of `llm` alone (explicit model control, so the repository
    API can unload and load it), its key in a file as a mounted Secret holds it."""
    work = tmp_path_factory.mktemp("restricted")
    repo = copy_repository(REPO_ROOT / "model_repository", work / "models", models=["llm"],
                           params={"llm": {"model": str(tiny_model_dir), **TINY_ENGINE_ARGS}})
    key_file = work / "admin-key"
    key_file.write_text(KEY + "\n")
    ports = ServerPorts.free()
    log = work / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), "--model-repository",
             str(repo), "--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
             "--metrics-port", str(ports.metrics), "--load-model", "llm",
             "--restrict-api-file", str(key_file)],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    http = f"http://127.0.0.1:{ports.http}"
    try:
        wait_for(lambda: model_ready(http), 300, process, log)
        yield http, f"127.0.0.1:{ports.grpc}"
    finally:
        process.terminate()  # serve stops tritonserver gracefully and reaps its stubs
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for(ready, timeout, process=None, log=None):
    deadline = time.monotonic() + timeout
    while not ready():
        if process is not None and process.poll() is not None:
            pytest.fail(f"serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, "not ready in time"
        time.sleep(0.25)


def model_ready(http: str) -> bool:
    try:
        return requests.get(f"{http}/v2/models/llm/ready", timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


def generate(http: str) -> str:
    r = requests.post(f"{http}/v2/models/llm/generate", timeout=60,
                      json={"text_input": "Hello", "parameters": {"max_tokens": 3,
                                                                  "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["text_output"]


def test_http_admin_apis_need_the_header_inference_stays_open(restricted):
    http, _ = restricted
    for method, path in (("post", "/v2/repository/models/llm/unload"),
                         ("post", "/v2/repository/index"), ("get", "/v2/models/llm/config"),
                         ("get", "/v2/systemsharedmemory/status"),
                         ("post", "/v2/logging")):
        for headers in ({}, {"admin-key": "wrong-key-0123456789"}):
            r = getattr(requests, method)(f"{http}{path}", headers=headers, timeout=10)
            assert r.status_code in (401, 403), (path, r.status_code, r.text)
            assert "admin-key" in r.text, r.text
    assert model_ready(http)  # nothing was unloaded
    r = requests.get(f"{http}/v2/models/llm/config", headers=ADMIN, timeout=10)
    assert r.status_code == 200 and r.json()["name"] == "llm"
    assert requests.post(f"{http}/v2/repository/index", headers=ADMIN, timeout=10).ok
    # Clients and probes need no key.
    assert generate(http)
    assert requests.get(f"{http}/v2/health/ready", timeout=10).status_code == 200
    assert requests.get(f"{http}/v2/models/llm", timeout=10).json()["name"] == "llm"


def test_openai_frontends_model_config_call_sends_the_key(restricted):
    from openai_frontend.errors import APIError
    from openai_frontend.triton_client import TritonLLM

    _, grpc = restricted

    async def max_model_len(key):
        llm = TritonLLM(grpc, "llm", key)
        try:
            return await llm.model_parameter("max_model_len")
        finally:
            await llm.close()

    assert asyncio.run(max_model_len(KEY)) == TINY_ENGINE_ARGS["max_model_len"]
    with pytest.raises(APIError) as refused:
        asyncio.run(max_model_len(None))
    assert "admin-key" in refused.value.message


def test_grpc_admin_apis_need_the_header_and_with_it_unload(restricted):
    """Last in the module: it unloads the model (a reload would cost ~50 s here)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    http, grpc = restricted
    client = grpcclient.InferenceServerClient(grpc)
    for call in (lambda h: client.unload_model("llm", headers=h),
                 lambda h: client.get_model_config("llm", headers=h),
                 lambda h: client.get_model_repository_index(headers=h)):
        for headers in (None, ADMIN, grpc_headers("wrong-key-0123456789")):
            with pytest.raises(InferenceServerException, match="admin-key"):
                call(headers)
    assert client.is_model_ready("llm")
    outcome = infer_one(grpc, "llm", llm_inputs("Hello", {"max_tokens": 3, "temperature": 0}))
    assert outcome.error is None and outcome.responses, outcome.error
    assert client.get_model_config("llm", headers=GRPC_ADMIN).config.name == "llm"

    client.unload_model("llm", headers=GRPC_ADMIN)
    wait_for(lambda: not model_ready(http), 60)
