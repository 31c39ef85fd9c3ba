"""n > 1 through the real server: one `text_output` entry per sequence, streaming and not,
reproducible with a seed, the prompt prefilled once; best_of and beam search refused."""
from __future__ import annotations

import pytest
import requests

from engine import SamplingParams
from tests.e2e.test_llm_load import wait_metric
from tests.e2e.triton_clients import infer_one, llm_inputs, metric, scrape_metrics

pytestmark = pytest.mark.slow

# Seen by no other test, so its first lookup in the server's prefix cache misses.
PROMPT = "Parallel sampling, three ways: " + "red green blue yellow " * 12
SEEDED = {"n": 3, "seed": 1234, "temperature": 1.0, "top_p": 0.95, "max_tokens": 16,
          "ignore_eos": True}
BLOCK_SIZE = 16  # TINY_ENGINE_ARGS
FLAGS = dict(return_num_input_tokens=True, return_num_output_tokens=True, return_finish_reason=True)


def entries(response, name="text_output") -> list:
    return [x.decode("utf-8") if isinstance(x, bytes) else x for x in response[name].tolist()]


def test_seeded_n3_gives_three_reproducible_outputs_and_prefills_once(server, reference):
    before = scrape_metrics(server.metrics)
    first = infer_one(server.grpc, "llm", llm_inputs(PROMPT, SEEDED, exclude_input_in_output=True,
                                                     **FLAGS))
    assert first.error is None and first.final and len(first.responses) == 1
    response = first.responses[0]
    texts = entries(response)
    assert len(texts) == 3 and len(set(texts)) == 3
    assert entries(response, "num_output_tokens") == [16, 16, 16]
    assert entries(response, "finish_reason") == ["length"] * 3
    expected = reference.generate([PROMPT], SamplingParams(**SEEDED))[0]
    assert texts == [c.text for c in expected.outputs]

    num_prompt = entries(response, "num_input_tokens")[0]
    full_blocks = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert full_blocks >= 3 * BLOCK_SIZE
    queries = wait_metric(server, "vllm:prefix_cache_queries_total", "llm",
                          lambda v: v >= metric(before, "vllm:prefix_cache_queries_total", "llm") + 3 * num_prompt)
    hits = metric(scrape_metrics(server.metrics), "vllm:prefix_cache_hits_total", "llm")
    assert queries - metric(before, "vllm:prefix_cache_queries_total", "llm") == 3 * num_prompt
    # Child 0 computed the prompt; its two siblings hit all of its full blocks.
    assert hits - metric(before, "vllm:prefix_cache_hits_total", "llm") == 2 * full_blocks

    again = infer_one(server.grpc, "llm", llm_inputs(PROMPT, SEEDED, exclude_input_in_output=True))
    assert entries(again.responses[0]) == texts
    prepended = infer_one(server.grpc, "llm", llm_inputs(PROMPT, SEEDED))
    assert entries(prepended.responses[0]) == [PROMPT + t for t in texts]


def test_seeded_n3_streams_three_entries_per_response(server, reference):
    expected = [c.text for c in reference.generate([PROMPT], SamplingParams(**SEEDED))[0].outputs]
    for _ in range(2):
        streamed = infer_one(server.grpc, "llm", llm_inputs(PROMPT, SEEDED, stream=True, **FLAGS))
        assert streamed.error is None and streamed.final and len(streamed.responses) > 1
        assert all(len(entries(r)) == 3 for r in streamed.responses)
        joined = ["".join(parts) for parts in zip(*(entries(r) for r in streamed.responses))]
        assert joined == expected
        counts = [sum(parts) for parts in zip(*(entries(r, "num_output_tokens")
                                                 for r in streamed.responses))]
        assert counts == [16, 16, 16]
        assert entries(streamed.responses[-1], "finish_reason") == ["length"] * 3


def test_http_generate_returns_one_text_per_sequence(server):
    params = {**SEEDED, "exclude_input_in_output": True}
    r = requests.post(f"{server.http}/v2/models/llm/generate",
                      json={"text_input": PROMPT, "parameters": params}, timeout=60)
    assert r.status_code == 200, r.text
    texts = r.json()["text_output"]
    assert isinstance(texts, list) and len(texts) == 3


@pytest.mark.parametrize("params,name", [({"best_of": 2}, "best_of"),
                                         ({"n": 2, "best_of": 3}, "best_of"),
                                         ({"use_beam_search": True}, "use_beam_search"),
                                         ({"n": 17}, "n")])
def test_best_of_beam_search_and_too_many_sequences_are_invalid_arg(server, params, name):
    r = requests.post(f"{server.http}/v2/models/llm/generate",
                      json={"text_input": "hi", "parameters": params}, timeout=60)
    assert r.status_code == 400, r.text  # INVALID_ARG
    assert name in r.json()["error"], r.text
