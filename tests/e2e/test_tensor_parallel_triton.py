"""`tensor_parallel_size: 2` in a vllm_backend-style model.json on a real tritonserver:
the Python backend's stub process is rank 0 and spawns the worker; greedy text equals
the in-process single-rank engine's, and unloading the model stops the worker. A worker
SIGKILLed under load errors every stream within seconds, the model (health check on)
unloads itself, and loads and serves again."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
import tritonclient.grpc as grpcclient

from bench.soak_client import SoakClient, StreamJob, encode_request
from bench.soak_requests import greedy_request
from tests.e2e.shared import TINY_ENGINE_ARGS, running_server, wait_unloaded
from tests.e2e.triton_clients import infer_one, llm_inputs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = ('backend: "tle"\ninstance_group [ { count: 1 kind: KIND_MODEL } ]\n'
          'parameters { key: "ENABLE_VLLM_HEALTH_CHECK" value: { string_value: "true" } }\n')
STREAMS = 8
ERROR_WITHIN_S = 15.0  # measured ~1 s: the step's collective fails as the worker goes


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


async def _kill_worker_under_load(url: str, workers: set[int]) -> tuple[float, list]:
    jobs = [StreamJob([encode_request("tp_llm", f"s{i}", greedy_request(
        f"Stream {i} says", 480, forced=True).tensors())]) for i in range(STREAMS)]
    client = SoakClient(url)
    tasks = [asyncio.create_task(client.run(job, timeout=120)) for job in jobs]
    deadline = time.monotonic() + 120
    while not all(j.outcomes.get(f"s{i}") and j.outcomes[f"s{i}"].pieces
                  for i, j in enumerate(jobs)):
        assert time.monotonic() < deadline and not any(t.done() for t in tasks), "stalled"
        await asyncio.sleep(0.1)
    (worker,) = workers
    killed_at = time.perf_counter()
    os.kill(worker, signal.SIGKILL)
    done = await asyncio.gather(*tasks)
    await client.close()
    return killed_at, [j.outcomes[f"s{i}"] for i, j in enumerate(done)]


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

        client = grpcclient.InferenceServerClient(server.grpc_url)
        killed_at, outcomes = asyncio.run(_kill_worker_under_load(server.grpc_url, workers))
        late = [(o.request_id, o.error) for o in outcomes
                if o.error is None or not 0 < o.error_at - killed_at <= ERROR_WITHIN_S]
        assert not late, late
        assert all("tensor-parallel worker died" in o.error for o in outcomes), outcomes[0].error
        deadline = time.monotonic() + 30
        while client.is_model_ready("tp_llm") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not client.is_model_ready("tp_llm")  # the health check unloaded it
        wait_unloaded(client, "tp_llm")
        client.load_model("tp_llm")
        again = infer_one(server.grpc_url, "tp_llm", llm_inputs(
            prompt, {"max_tokens": 12, "temperature": 0, "ignore_eos": True},
            exclude_input_in_output=True))
        assert again.error is None and again.text == expected.outputs[0].text
        workers = _spawned_workers(server)
        assert len(workers) == 1
        client.unload_model("tp_llm")
        deadline = time.monotonic() + 30
        while workers & _spawned_workers(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not workers & _spawned_workers(server)
