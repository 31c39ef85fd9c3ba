"""vllm_backend's CI behaviours that need scripts/serve.py around tritonserver: its stub
watch must tell a model's short-lived auto-complete stub from a dead instance, and tell a
stub that crashed during a graceful stop. Plain Python models only (no engine): fast."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend.triton_server import REPO_ROOT, ServerPorts

pytestmark = pytest.mark.slow

# Two plain Python models written for this test: add_sub (python_backend's example
# interface: INPUT0 + INPUT1, INPUT0 - INPUT1) and a decoupled one whose requests take
# minutes (as an engine model's long stream).
ADD_SUB_CONFIG = """name: "add_sub"
backend: "python"
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
instance_group [ { kind: KIND_CPU } ]
"""
ADD_SUB_MODEL = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            answers.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return answers
"""
SLOW_CONFIG = """name: "slow"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""
SLOW_MODEL = """import os
import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "running")

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.answer, args=(request.get_response_sender(),),
                             daemon=True).start()
        open(self.marker, "w").close()
        return None

    def answer(self, sender):
        time.sleep(600)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


def write_model(repo: Path, name: str, config: str, model: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(model)


class Serve:
    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.repo = tmp_path / "models"
        write_model(self.repo, "add_sub", ADD_SUB_CONFIG, ADD_SUB_MODEL)
        write_model(self.repo, "slow", SLOW_CONFIG, SLOW_MODEL)
        self.ports = ServerPorts.free()
        self.log = tmp_path / "serve.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"),
                 "--model-repository", str(self.repo), "--load-model", "slow",
                 "--http-port", str(self.ports.http), "--grpc-port", str(self.ports.grpc),
                 "--metrics-port", str(self.ports.metrics), *extra],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        deadline = time.monotonic() + 300
        while not self.http_ok("/v2/health/ready"):
            assert self.process.poll() is None, f"serve exited\n{self.tail()}"
            assert time.monotonic() < deadline, f"serve not ready\n{self.tail()}"
            time.sleep(0.25)

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def http_ok(self, path: str, method: str = "GET") -> bool:
        request = urllib.request.Request(f"http://127.0.0.1:{self.ports.http}{path}", method=method,
                                         data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                return answer.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # its tritonserver and stubs die with it (PDEATHSIG, reaper)
            self.process.wait()


@pytest.fixture
def serve(tmp_path):
    made: list[Serve] = []

    def start(*extra: str) -> Serve:
        made.append(Serve(tmp_path, *extra))
        return made[-1]

    yield start
    for served in made:
        served.close()


def add_sub(url: str) -> None:
    a, b = np.random.rand(4).astype(np.float32), np.random.rand(4).astype(np.float32)
    inputs = [grpcclient.InferInput("INPUT0", [4], "FP32"), grpcclient.InferInput("INPUT1", [4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    with grpcclient.InferenceServerClient(url) as client:
        result = client.infer("add_sub", inputs, request_id="10")
    assert np.allclose(result.as_numpy("OUTPUT0"), a + b)
    assert np.allclose(result.as_numpy("OUTPUT1"), a - b)


def stub_pids(name: str) -> list[int]:
    """Python backend stubs whose argv names `name` (an instance or, for the auto-complete
    stub, the model)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"triton_python_backend_stub") and name.encode() in argv:
            pids.append(int(entry.name))
    return pids


def test_a_python_model_loaded_at_run_time_leaves_serve_running(serve):
    """Mirrors L0_backend_vllm/vllm_backend test_vllm_triton_backend, which loads
    python_backend's add_sub at run time in explicit model-control mode, serves it, unloads
    and loads models around it: the python backend's auto-complete stub for add_sub, named
    after the model, exits once add_sub's config is filled in, while add_sub turns READY;
    serve's stub watch took it for a dead instance and killed tritonserver every time. Its
    unloads and loads also end instance stubs whose model is READY again by the watch's
    next look (here made certain: add_sub loaded anew while loaded)."""
    served = serve()
    for _ in range(3):  # each load runs a new auto-complete stub
        assert served.http_ok("/v2/repository/models/add_sub/load", "POST"), served.tail()
        assert served.http_ok("/v2/models/add_sub/ready")
        add_sub(served.grpc)
        # The watch looks once a second; give it several looks at the stub that left.
        time.sleep(3)
        assert served.process.poll() is None, served.tail()
        add_sub(served.grpc)
        assert served.http_ok("/v2/repository/models/add_sub/unload", "POST")
    # Loaded again while loaded, its files changed: Triton starts the new instance, switches
    # to it and ends the old stub, the model READY throughout (that stub's exit is no death).
    assert served.http_ok("/v2/repository/models/add_sub/load", "POST"), served.tail()
    for round_ in range(2):
        model_py = served.repo / "add_sub" / "1" / "model.py"
        model_py.write_text(model_py.read_text() + f"# changed {round_}\n")
        assert served.http_ok("/v2/repository/models/add_sub/load", "POST"), served.tail()
        time.sleep(3)
        assert served.process.poll() is None, served.tail()
        add_sub(served.grpc)
    assert "backend stub died" not in served.log.read_text(errors="replace"), served.tail()
    assert served.process.poll() is None and served.http_ok("/v2/models/slow/ready"), served.tail()


def test_a_stub_that_crashes_during_a_graceful_stop_is_logged(serve):
    """serve learns of stub exits from its stub watch (backend/stub_watch.py): during a
    graceful stop it only said tritonserver's status (0); a stub killed by a signal while
    the stop drains requests is now logged with the signal. serve still exits 0 (a stop was
    asked for)."""
    served = serve("--exit-timeout-secs", "10")
    marker = served.repo / "slow" / "running"
    client = grpcclient.InferenceServerClient(served.grpc)
    client.start_stream(callback=lambda result, error: None)
    client.async_stream_infer("slow", [_one_float()], request_id="1")
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline, served.tail()
        time.sleep(0.05)
    (stub,) = stub_pids("slow_0_0")
    time.sleep(1.5)  # the watch has listed the stub (it looks once a second)
    os.kill(served.process.pid, signal.SIGTERM)
    threading.Event().wait(0.5)
    os.kill(stub, signal.SIGKILL)
    assert served.process.wait(timeout=120) == 0, served.tail()
    client.close()
    log = served.log.read_text(errors="replace")
    assert (f"serve: backend stub crashed during the stop: slow_0_0 (model slow, pid {stub}, "
            "killed by SIGKILL)") in log, served.tail()


def _one_float() -> grpcclient.InferInput:
    value = grpcclient.InferInput("IN", [1], "FP32")
    value.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    return value
