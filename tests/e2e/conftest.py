"""One real tritonserver per test session, serving a temp copy of model_repository
whose engine models run a tiny random-weight Llama (plus a faulty and a default
SmolLM2 copy of `llm`). Logs go to test-logs/ when a test fails."""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT, ServerPorts, TritonServer, free_port
from tests.e2e.shared import DEFAULT_MODEL_ARGS, FAILURE_STEP, FAULTY_MAX_NUM_SEQS, TINY_ENGINE_ARGS
from tests.vllm_side import vllm_side  # noqa: F401  (the fixture: vLLM's code reads what a server sent)

@dataclass
class Server:
    handle: TritonServer
    model_dir: Path
    # `llm` publishes KV-cache events (sha256_cbor keys) on these TCP ports; the two
    # instances of `llm_replicas` on REPLICA_KV_PORTS[rank] (+ rank, as vLLM's DP ranks).
    kv_events_port: int = 0
    kv_replay_port: int = 0
    replica_kv_ports: tuple[int, int] = (0, 0)

    @property
    def grpc(self) -> str:
        return self.handle.grpc_url

    @property
    def http(self) -> str:
        return f"http://{self.handle.http_url}"

    @property
    def metrics(self) -> str:
        return self.handle.metrics_url


def free_port_pair() -> int:
    """A free port whose successor is free too."""
    import socket

    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port + 1))
            except OSError:
                continue
        return port


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if outcome.get_result().failed:
        item.session.e2e_failed = True


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from testing.tiny_model import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def server(request, tmp_path_factory, tiny_model_dir) -> Server:
    work = tmp_path_factory.mktemp("triton")
    tiny = {"model": str(tiny_model_dir), **TINY_ENGINE_ARGS}
    kv_events_port, kv_replay_port = free_port(), free_port()
    kv_events = {"prefix_caching_hash_algo": "sha256_cbor", "kv_events_config": json.dumps(
        {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{kv_events_port}",
         "replay_endpoint": f"tcp://*:{kv_replay_port}", "topic": "kv@llm"})}
    # Rank r adds r to both ports, so each needs its successor free too.
    replica_kv_ports = (free_port_pair(), free_port_pair())
    while replica_kv_ports[1] - replica_kv_ports[0] in (-1, 0, 1):
        replica_kv_ports = (replica_kv_ports[0], free_port_pair())
    replica_events = {"prefix_caching_hash_algo": "sha256_cbor", "kv_events_config": json.dumps(
        {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{replica_kv_ports[0]}",
         "replay_endpoint": f"tcp://*:{replica_kv_ports[1]}"})}
    repo = copy_repository(
        REPO_ROOT / "model_repository", work / "models",
        models=["llm", "tensorrt_llm", "preprocessing", "postprocessing", "ensemble"],
        renames={"llm_faulty": "llm", "llm_default": "llm", "llm_priority": "llm",
                 "llm_replicas": "llm", "llm_fair": "llm"},
        instances={"llm_replicas": (2, "KIND_CPU")},
        params={"llm": {**tiny, **kv_events}, "tensorrt_llm": tiny,
                "llm_replicas": {**tiny, **replica_events},
                "llm_faulty": {**tiny, "inject_failure_at_step": str(FAILURE_STEP),
                               "max_num_seqs": str(FAULTY_MAX_NUM_SEQS)},
                "llm_default": {"model": "", **DEFAULT_MODEL_ARGS},
                "llm_priority": {**tiny, "policy": "priority", "max_num_seqs": "2",
                                 "num_kv_blocks": "33"},
                "llm_fair": {**tiny, "policy": "fair", "admission": "no_evict",
                             "tenant_weights": '{"gold": 2}'},
                "preprocessing": {"tokenizer": str(tiny_model_dir)},
                "postprocessing": {"tokenizer": str(tiny_model_dir)}})
    log = work / "tritonserver.log"
    handle = TritonServer(repo, ServerPorts.free(), log_path=log,
                          extra_args=["--log-verbose=0", "--exit-timeout-secs=15"])
    handle.start()
    ready = False
    try:
        handle.wait_ready(timeout=420)
        ready = True
        yield Server(handle, tiny_model_dir, kv_events_port, kv_replay_port, replica_kv_ports)
    finally:
        handle.stop()
        if getattr(request.session, "e2e_failed", False) or not ready:
            target = REPO_ROOT / "test-logs"
            target.mkdir(exist_ok=True)
            shutil.copyfile(log, target / f"e2e-tritonserver-{time.strftime('%Y%m%d-%H%M%S')}.log")


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """The in-process engine the served text must equal."""
    from engine import LLM

    return LLM(model=str(tiny_model_dir), **TINY_ENGINE_ARGS)

