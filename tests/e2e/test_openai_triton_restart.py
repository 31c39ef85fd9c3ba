"""tritonserver restarted under the OpenAI route (issue 28, item 3): while it is down the
route answers 503 (completions and /health) at once, and once it is back the same route
process serves again, without a restart of its own."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT, ServerPorts, TritonServer
from tests.e2e.shared import TINY_ENGINE_ARGS
from tests.e2e.test_openai_frontend import SERVED, start_frontend, stop_frontend

pytestmark = pytest.mark.slow

BACK_WITHIN_S = 10.0  # after Triton is ready again; the channel reconnects in ~1 s
BODY = {"model": SERVED, "prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0}


@dataclass
class Target:
    """What start_frontend reads of a server."""
    grpc: str
    metrics: str
    model_dir: Path


def _server(repo: Path, ports: ServerPorts, log: Path) -> TritonServer:
    handle = TritonServer(repo, ports, log_path=log,
                          extra_args=["--model-control-mode=explicit", "--load-model=llm",
                                      "--exit-timeout-secs=15"])
    handle.start()
    handle.wait_ready(timeout=300)
    return handle


def test_route_answers_503_while_triton_is_down_and_serves_after(tmp_path, tiny_model_dir):
    repo = copy_repository(REPO_ROOT / "model_repository", tmp_path / "models", models=["llm"],
                           params={"llm": {"model": str(tiny_model_dir), **TINY_ENGINE_ARGS}})
    ports = ServerPorts.free()
    handle = _server(repo, ports, tmp_path / "triton1.log")
    process, url = start_frontend(Target(handle.grpc_url, handle.metrics_url, tiny_model_dir))
    try:
        before = requests.post(f"{url}/v1/completions", json=BODY, timeout=60)
        assert before.status_code == 200, before.text
        handle.stop()
        started = time.monotonic()
        down = requests.post(f"{url}/v1/completions", json=BODY, timeout=30)
        assert down.status_code == 503, down.text
        assert down.json()["error"]["type"] == "service_unavailable_error"
        assert requests.get(f"{url}/health", timeout=30).status_code == 503
        assert time.monotonic() - started < 30  # an answer, not a hang

        handle = _server(repo, ports, tmp_path / "triton2.log")
        deadline = time.monotonic() + BACK_WITHIN_S
        while True:
            after = requests.post(f"{url}/v1/completions", json=BODY, timeout=60)
            if after.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        assert process.poll() is None  # the same route process throughout
    finally:
        stop_frontend(process)
        handle.stop()
