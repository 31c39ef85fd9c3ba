"""instance_group count 2: two engines behind one model name, Triton spreading requests
over them; outputs as from one engine, one metrics series and one KV-event stream per
instance (vLLM's data-parallel ranks: ports + rank, the rank in every batch)."""
from __future__ import annotations

import time

import pytest

from tests.e2e.shared import PROMPTS, greedy
from tests.e2e.triton_clients import infer_many, llm_inputs, metric_by_instance, scrape_metrics
from tests.engine.core.kv_cache.test_kv_events import _replay_all
from tuning.kv_index import KVEventIndex, decode_batch

pytestmark = pytest.mark.slow
MODEL = "llm_replicas"


def test_two_instances_serve_concurrently_with_their_own_engines(server, reference):
    prompts = [f"{p} ({i})" for i in range(3) for p in PROMPTS]
    expected = reference.generate(prompts, greedy(12))
    outcomes = infer_many(server.grpc, MODEL, [
        llm_inputs(p, {"temperature": 0, "max_tokens": 12}, exclude_input_in_output=True)
        for p in prompts])
    assert [o.text for o in outcomes] == [e.outputs[0].text for e in expected]

    deadline = time.monotonic() + 10
    while True:  # metrics are recorded on each instance's own thread
        values = scrape_metrics(server.metrics)
        tokens = metric_by_instance(values, "vllm:generation_tokens_total", MODEL)
        if sum(tokens.values()) >= 12 * len(prompts) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(tokens) == 2, tokens
    assert sum(tokens.values()) == 12 * len(prompts)
    # Both engines took a share of the 24 concurrent requests.
    assert all(value > 0 for value in tokens.values()), tokens
    info = metric_by_instance(values, "vllm:cache_config_info", MODEL)
    assert sorted(info) == sorted(tokens) and set(info.values()) == {1.0}

    ranks = {}
    for rank in (0, 1):
        replayed = _replay_all(server.replica_kv_ports[1] + rank, 0)
        assert replayed, f"rank {rank} published nothing"
        index = KVEventIndex()
        for seq, payload in replayed:
            index.apply(seq, payload)
            ranks.setdefault(rank, set()).add(decode_batch(payload)[2])
        assert index.keys
    assert ranks == {0: {0}, 1: {1}}
