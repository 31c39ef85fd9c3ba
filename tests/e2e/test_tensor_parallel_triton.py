"""`tensor_parallel_size: 2` in a vllm_backend-style model.json on a real tritonserver:
the Python backend's stub process is rank 0 and spawns the worker; greedy text equals
the in-process single-rank engine's, and unloading the model stops the worker."""
from __future__ import annotations

import json
import time

import pytest
import tritonclient.grpc as grpcclient

from tests.e2e.shared import TINY_ENGINE_ARGS, running_server
from tests.e2e.triton_clients import infer_one, llm_inputs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = 'backend: "tle"\ninstance_group [ { count: 1 kind: KIND_MODEL } ]\n'


def _spawned_workers(server) -> set[int]:
    """Pids of live multiprocessing-spawned processes under the server (the TP workers);
    other programs on the host may spawn too (vLLM's CPU build does)."""
    import psutil
    try:
        below = psutil.Process(server.process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for p in below:
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                found.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def test_model_json_tensor_parallel_size_2_serves_and_unloads(tmp_path, tiny_model_dir,
                                                             reference):
    repo = tmp_path / "models"
    (repo / "tp_llm" / "1").mkdir(parents=True)
    (repo / "tp_llm" / "config.pbtxt").write_text(CONFIG)
    (repo / "tp_llm" / "1" / "model.json").write_text(json.dumps(
        {"model": str(tiny_model_dir), "tensor_parallel_size": 2, **TINY_ENGINE_ARGS}))
    with running_server(repo, tmp_path, load=["tp_llm"]) as server:
        workers = _spawned_workers(server)
        assert len(workers) == 1
        prompt = "The capital of France is"
        outcome = infer_one(server.grpc_url, "tp_llm", llm_inputs(
            prompt, {"max_tokens": 12, "temperature": 0, "ignore_eos": True},
            exclude_input_in_output=True))
        assert outcome.error is None
        from engine import SamplingParams
        expected = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                               ignore_eos=True))[0]
        assert outcome.text == expected.outputs[0].text
        grpcclient.InferenceServerClient(server.grpc_url).unload_model("tp_llm")
        deadline = time.monotonic() + 30
        while workers & _spawned_workers(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not workers & _spawned_workers(server)
