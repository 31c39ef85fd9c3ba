"""Structured outputs through the real server: vllm_backend's and the older key, streaming
and not, every output valid; a bad schema is INVALID_ARG naming the field."""
from __future__ import annotations

import json

import pytest
import requests

from engine import SamplingParams
from tests.e2e.triton_clients import infer_many, infer_one, llm_inputs
from tests.engine.structured_output.test_structured_output import SCHEMAS

pytestmark = pytest.mark.slow

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,", "Once upon a time"]


def spec(name, key):
    schema = SCHEMAS[name].json_schema()
    # vllm_backend's clients send structured_outputs as JSON text inside the JSON.
    return {key: json.dumps({"json": schema}) if key == "structured_outputs" else {"json": schema}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_outputs_parse_and_validate(server, reference, stream):
    cases = [(name, key, sampling)
             for name in ("nested_object", "enum", "integer_range", "array")
             for key in ("structured_outputs", "guided_decoding")
             for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3})]
    outcomes = infer_many(server.grpc, "llm", [
        llm_inputs(PROMPTS[i % len(PROMPTS)], {**spec(name, key), **sampling, "max_tokens": 300},
                   stream=stream, exclude_input_in_output=True, return_finish_reason=True)
        for i, (name, key, sampling) in enumerate(cases)])
    for (name, key, sampling), outcome in zip(cases, outcomes):
        assert outcome.final and outcome.responses[-1]["finish_reason"][0].decode() == "stop"
        SCHEMAS[name].validate_json(outcome.text, strict=True)
        if stream:
            assert len(outcome.responses) > 1
    # The server's greedy constrained text is the in-process engine's.
    expected = reference.generate(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=300, structured_outputs={"json": SCHEMAS["nested_object"].json_schema()}))
    assert outcomes[0].text == expected[0].outputs[0].text


def test_choice_and_regex_over_http_generate(server):
    for sampling, check in (({"guided_decoding": {"choice": ["red", "green"]}},
                             lambda t: t in ("red", "green")),
                            ({"structured_outputs": json.dumps({"regex": "[a-c]{3}[0-9]"})},
                             lambda t: len(t) == 4 and t[:3].strip("abc") == "" and t[3].isdigit())):
        body = {"text_input": "Pick:", "exclude_input_in_output": True,
                "sampling_parameters": json.dumps({**sampling, "temperature": 1.0, "max_tokens": 20})}
        r = requests.post(f"{server.http}/v2/models/llm/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert check(r.json()["text_output"]), r.text


@pytest.mark.parametrize("sampling,fragment", [
    ({"guided_decoding": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
    ({"structured_outputs": json.dumps({"regex": "[a-"})}, "structured_outputs.regex"),
    ({"guided_decoding": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
])
def test_invalid_spec_is_invalid_arg(server, sampling, fragment):
    body = {"text_input": "hi", "sampling_parameters": json.dumps(sampling)}
    r = requests.post(f"{server.http}/v2/models/llm/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text  # INVALID_ARG
    assert fragment in r.json()["error"], r.text
    outcome = infer_one(server.grpc, "llm", llm_inputs("hi", sampling))
    assert outcome.error and fragment in outcome.error
