"""`bash scripts/serve.sh` as a fresh machine runs it: no kernel cache, no LANG / LC_*
(the C locale, in which Triton's python stub decodes text as ASCII), and a compiler that
prints non-ASCII warnings (gcc's curly quotes, as gcc 12 printed for -march=native on
Sapphire Rapids). The stub builds the kernels itself and the model serves."""
from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request

import pytest

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT, ServerPorts
from tests.e2e.shared import TINY_ENGINE_ARGS
from tests.kernels.cpu.test_build_warnings import GCC, ascii_locale_env, noisy_compiler

pytestmark = [pytest.mark.slow, pytest.mark.skipif(GCC is None, reason="no gcc")]
READY_TIMEOUT_S = 420.0


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/llm/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_serve_sh_builds_the_kernels_in_the_stub_and_serves(tmp_path, tiny_model_dir):
    cache = tmp_path / "cache"
    params = {"model": str(tiny_model_dir), **TINY_ENGINE_ARGS}
    repo = copy_repository(REPO_ROOT / "model_repository", tmp_path / "models",
                           models=["llm"], params={"llm": params})
    ports = ServerPorts.free()
    env = ascii_locale_env(CC=str(noisy_compiler(tmp_path)), TLE_CACHE_DIR=str(cache))
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        serve = subprocess.Popen(
            ["bash", "scripts/serve.sh", "--model-repository", str(repo),
             "--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
             "--metrics-port", str(ports.metrics)],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
    try:
        started = time.monotonic()
        while not _ready(ports.http):
            text = log.read_text(errors="replace")
            assert serve.poll() is None, f"serve exited\n{text[-4000:]}"
            assert time.monotonic() - started < READY_TIMEOUT_S, f"not ready\n{text[-4000:]}"
            time.sleep(0.5)
        body = json.dumps({"text_input": "Hello", "parameters": {"max_tokens": 4,
                                                                 "temperature": 0}}).encode()
        with urllib.request.urlopen(f"http://127.0.0.1:{ports.http}/v2/models/llm/generate",
                                    data=body, timeout=60) as response:
            assert json.load(response)["text_output"]
        # Built by the stub in this run (the cache was empty), not found ready-made.
        assert list((cache / "cpu_kernels").glob("cpu_kernels-*.so"))
        assert "UnicodeDecodeError" not in log.read_text(errors="replace")
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            assert serve.wait(60) == 0, log.read_text(errors="replace")[-4000:]
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
            raise
