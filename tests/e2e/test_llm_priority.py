"""policy=priority through Triton: a late high-priority request (lower value first, as in
vLLM) overtakes earlier low-priority ones, and when the KV pool runs out the victim is
the low-priority request, not the newest one (real server, tiny model)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.e2e.shared import PROMPTS, greedy
from tests.e2e.triton_clients import llm_inputs, metric, scrape_metrics, tensors_to_inputs

pytestmark = pytest.mark.slow

MODEL = "llm_priority"  # policy=priority, max_num_seqs=2, a pool of 33 blocks (tests/e2e/conftest.py)
# The lows run longest: two of them need 58 blocks of the 33, so one is preempted early and
# the high one is admitted beside the other; then the pair outgrows the pool again, and the
# victim must be that low one (fcfs would take the high one: the tail of RUNNING).
LOW_TOKENS, HIGH_TOKENS = 450, 300


def test_late_high_priority_request_finishes_first_and_low_priority_is_preempted(server, reference):
    before = metric(scrape_metrics(server.metrics), "vllm:num_preemptions_total", MODEL)
    finished_at: dict[str, float] = {}
    texts: dict[str, list[str]] = {}
    first_tokens = threading.Semaphore(0)
    errors: list[str] = []

    def callback(result, error):
        if error is not None:
            errors.append(str(error))
            return
        response = result.get_response()
        out = result.as_numpy("text_output")
        if out is not None and out.size:
            if response.id not in texts:
                first_tokens.release()
            texts.setdefault(response.id, []).append(out[0].decode())
        if response.parameters["triton_final_response"].bool_param:
            finished_at[response.id] = time.monotonic()

    def send(request_id: str, prompt: str, priority: int, tokens: int) -> None:
        tensors = llm_inputs(prompt, {"max_tokens": tokens, "min_tokens": tokens, "temperature": 0},
                             stream=True)
        tensors["priority"] = np.array([priority], dtype=np.int32)
        client.async_stream_infer(MODEL, tensors_to_inputs(tensors), request_id=request_id,
                                  enable_empty_final_response=True)

    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=callback)
    try:
        for i in range(3):
            send(f"low{i}", PROMPTS[i], 10, LOW_TOKENS)
        for _ in range(2):  # the two lows that fit max_num_seqs are decoding
            assert first_tokens.acquire(timeout=60)
        send("high", PROMPTS[3], 0, HIGH_TOKENS)
        deadline = time.monotonic() + 120
        while len(finished_at) < 4 and not errors and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.stop_stream()
        client.close()
    assert not errors, errors
    assert min(finished_at, key=finished_at.get) == "high", finished_at
    preemptions = metric(scrape_metrics(server.metrics), "vllm:num_preemptions_total", MODEL) - before
    assert preemptions >= 2
    # Preemption by recompute changes nothing in the outputs.
    expected = reference.generate([PROMPTS[3], PROMPTS[0]], [
        greedy(HIGH_TOKENS, min_tokens=HIGH_TOKENS), greedy(LOW_TOKENS, min_tokens=LOW_TOKENS)])
    assert "".join(texts["high"]) == expected[0].outputs[0].text
    assert "".join(texts["low0"]) == expected[1].outputs[0].text
