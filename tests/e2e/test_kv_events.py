"""KV-cache events from a model served by the real Triton server: configured as vLLM's
`kv_events_config` in config.pbtxt, replayed from sequence 0 over the ROUTER socket, and
keyed so that an indexer hashing the prompt's tokens outside finds the served prompt."""
from __future__ import annotations

import os
import time

import pytest

from tests.e2e.triton_clients import infer_many, llm_inputs
from tests.engine.core.kv_cache.test_kv_events import _replay_all, _subscriber, outside_sha256_cbor_chain
from tuning.kv_index import KVEventIndex

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16  # TINY_ENGINE_ARGS


def test_served_prompts_are_found_by_an_outside_indexer(server):
    from transformers import AutoTokenizer

    sub = _subscriber(server.kv_events_port, b"kv@llm")
    time.sleep(0.5)  # PUB drops messages sent before the subscription reaches it
    shared = "Shared system prompt for every tenant of the cluster. " * 8
    prompts = [shared + tail for tail in ("Question one?", "Another question here?")]
    outcomes = infer_many(server.grpc, "llm", [
        llm_inputs(p, {"temperature": 0, "max_tokens": 4}) for p in prompts])
    assert all(o.final and o.error is None for o in outcomes)
    tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    prompt_keys = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        keys = [int.from_bytes(h[-8:], "big")
                for h in outside_sha256_cbor_chain(ids, BLOCK_SIZE, seed=seed)]
        # Every full block but a last one holding the final prompt token is cached
        # (the engine computes that token again to sample), plus whatever decode filled.
        prompt_keys.append((keys, (len(ids) - 1) // BLOCK_SIZE))
    # Everything the model published since it loaded, other tests' requests included.
    # The publisher thread sends a step's batch a moment after the step: ask again
    # until the last one is in.
    deadline = time.monotonic() + 10
    while True:
        replayed = _replay_all(server.kv_replay_port, 0, topic=b"kv@llm")
        index = KVEventIndex()
        for seq, payload in replayed:
            index.apply(seq, payload)
        if all(index.prefix_hits(k) >= need for k, need in prompt_keys) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    seqs = [seq for seq, _ in replayed]
    assert seqs == list(range(len(seqs))) and seqs
    for keys, need in prompt_keys:
        assert index.prefix_hits(keys) >= need >= 3
    # The live stream carried the same batches, under the configured topic.
    live = {}
    while sub.poll(500):
        topic, seq_bytes, payload = sub.recv_multipart()
        assert topic == b"kv@llm"
        live[int.from_bytes(seq_bytes, "big")] = payload
    assert live and all(dict(replayed)[seq] == payload for seq, payload in live.items())
    sub.close(linger=0)
