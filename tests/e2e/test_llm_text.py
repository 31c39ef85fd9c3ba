"""The `llm` model's text path against the in-process engine (real server)."""
from __future__ import annotations

import json

import pytest
import requests

from tests.e2e.shared import DEFAULT_MODEL_ARGS, PROMPTS, greedy
from tests.e2e.triton_clients import infer_many, infer_one, llm_inputs

pytestmark = pytest.mark.slow


def test_greedy_text_equals_engine(server, reference):
    expected = reference.generate(PROMPTS, greedy(24))
    outcomes = infer_many(server.grpc, "llm", [
        llm_inputs(p, {"temperature": 0, "max_tokens": 24}, exclude_input_in_output=True) for p in PROMPTS])
    assert [o.text for o in outcomes] == [e.outputs[0].text for e in expected]
    assert all(len(o.responses) == 1 and o.final for o in outcomes)
    # Without the flag the prompt is prepended (non-streaming default).
    prepended = infer_one(server.grpc, "llm", llm_inputs(PROMPTS[0], {"temperature": 0, "max_tokens": 24}))
    assert prepended.text == PROMPTS[0] + expected[0].outputs[0].text


def test_stream_deltas_concatenate_to_full_text(server, reference):
    expected = reference.generate(PROMPTS, greedy(40))
    outcomes = infer_many(server.grpc, "llm", [
        llm_inputs(p, {"temperature": "0", "max_tokens": "40"}, stream=True) for p in PROMPTS])
    for outcome, exp in zip(outcomes, expected):
        assert outcome.text == exp.outputs[0].text
        assert outcome.final
        assert len(outcome.responses) > 1  # really streamed
        # Every response but possibly the last carries text; FINAL rides on the last.
        assert all(t for t in outcome.texts()[:-1])


def test_return_outputs(server, reference):
    prompt = PROMPTS[1]
    expected = reference.generate([prompt], greedy(12, logprobs=0))[0]
    flags = dict(return_finish_reason=True, return_num_input_tokens=True, return_num_output_tokens=True,
                 return_cumulative_logprob=True, return_logprobs=True)
    full = infer_one(server.grpc, "llm", llm_inputs(prompt, {"temperature": 0, "max_tokens": 12,
                                                             "logprobs": 0},
                                                    exclude_input_in_output=True, **flags))
    assert full.error is None
    r = full.responses[0]
    assert r["finish_reason"][0].decode() == expected.outputs[0].finish_reason
    assert int(r["num_input_tokens"][0]) == len(expected.prompt_token_ids)
    assert int(r["num_output_tokens"][0]) == len(expected.outputs[0].token_ids)
    assert r["cumulative_logprob"][0] == pytest.approx(expected.outputs[0].cumulative_logprob, abs=1e-3)
    logprobs = json.loads(r["logprobs"][0])
    assert [int(next(iter(d))) for d in logprobs] == expected.outputs[0].token_ids

    streamed = infer_one(server.grpc, "llm", llm_inputs(prompt, {"temperature": 0, "max_tokens": 12,
                                                                 "logprobs": 0},
                                                        stream=True, **flags))
    counts = [int(x["num_output_tokens"][0]) for x in streamed.responses]
    assert sum(counts) == len(expected.outputs[0].token_ids)
    assert sum(len(json.loads(x["logprobs"][0])) for x in streamed.responses) == sum(counts)
    reasons = [x["finish_reason"][0].decode() for x in streamed.responses]
    assert reasons[-1] == expected.outputs[0].finish_reason and set(reasons[:-1]) <= {"None"}


def test_genai_perf_vllm_format_exact_token_count(server):
    # genai-perf's vllm format: string-valued sampling parameters, stream + exclude.
    outcomes = infer_many(server.grpc, "llm", [
        llm_inputs(p, {"max_tokens": "32", "min_tokens": "32", "ignore_eos": "false"}, stream=True,
                   exclude_input_in_output=True, return_num_output_tokens=True) for p in PROMPTS[:4]])
    for outcome in outcomes:
        assert sum(int(r["num_output_tokens"][0]) for r in outcome.responses) == 32


def test_http_generate_and_generate_stream(server, reference):
    expected = reference.generate([PROMPTS[0]], greedy(20))[0].outputs[0].text
    params = {"temperature": 0, "max_tokens": 20, "exclude_input_in_output": True}
    r = requests.post(f"{server.http}/v2/models/llm/generate",
                      json={"text_input": PROMPTS[0], "parameters": params}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == expected

    r = requests.post(f"{server.http}/v2/models/llm/generate_stream",
                      json={"text_input": PROMPTS[0], "parameters": {**params, "stream": True}},
                      stream=True, timeout=60)
    assert r.status_code == 200
    events = [json.loads(line[len("data: "):]) for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: ")]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == expected

    # Inputs may also be top-level fields; sampling_parameters then wins over parameters.
    r = requests.post(f"{server.http}/v2/models/llm/generate",
                      json={"text_input": PROMPTS[0], "exclude_input_in_output": True,
                            "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 20})},
                      timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == expected


def test_default_smollm2_model(server):
    from engine import LLM

    prompt = "The capital of France is"
    expected = LLM(model=None, **DEFAULT_MODEL_ARGS).generate([prompt], greedy(16))[0].outputs[0].text
    outcome = infer_one(server.grpc, "llm_default",
                        llm_inputs(prompt, {"temperature": 0, "max_tokens": 16}, stream=True))
    assert outcome.error is None
    assert outcome.text == expected
    assert "Paris" in outcome.text
