"""The `llm` model's prompt_logprobs output without a server (issue 47): asked in
sampling_parameters, sent once in vLLM's layout with the `logprobs` output's item style,
one identical text per sequence entry, and refused past MAX_PROMPT_LOGPROBS_ENTRIES
naming it; plus the new tensors in the auto-completed config and the runner arguments
in model.json. The real server's side is tests/e2e/test_pooling_triton.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend.config_params import split_parameters
from backend.llm_config import complete_llm_config
from backend.llm_responses import LLMResponseBuilder
from backend.model_json import parse_model_json
from backend.prompt_limits import check_prompt_logprobs_size
from backend.request_parsing import InvalidRequest, parse_llm_request
from engine.api import CompletionOutput, Logprob, RequestOutput
from tests.backend.test_llm_config import ModelConfig

PROMPT_LOGPROBS = [None, {7: Logprob(-2.5, 4), 3: Logprob(-0.5, 1)},
                   {9: Logprob(-0.25, 1), 2: Logprob(-1.75, 2)}]


def parsed(sampling: dict, **flags):
    inputs = {"text_input": np.array([b"hi there"], dtype=np.object_),
              "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_)}
    for name, value in flags.items():
        inputs[name] = np.array([value])
    return parse_llm_request(inputs)


def output(prompt_logprobs, n=1):
    completions = [CompletionOutput(i, "x", [5], finish_reason="length") for i in range(n)]
    return RequestOutput("r", "hi there", [1, 7, 9], completions, True,
                         prompt_logprobs=prompt_logprobs)


def test_prompt_logprobs_parse_as_vllm_names_them():
    assert parsed({"prompt_logprobs": 2}).params.prompt_logprobs == 2
    assert parsed({"prompt_logprobs": "0"}).params.prompt_logprobs == 0
    assert parsed({}).params.prompt_logprobs is None
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        parsed({"prompt_logprobs": -1})


def test_the_output_is_vllms_layout_in_the_logprobs_item_style():
    builder = LLMResponseBuilder(parsed({"prompt_logprobs": 1}), decode_token=lambda t: f"<{t}>")
    tensors = builder.build(output(PROMPT_LOGPROBS))
    (text,) = tensors["prompt_logprobs"]
    assert json.loads(text) == [
        None,
        {"7": {"logprob": -2.5, "rank": 4, "decoded_token": "<7>"},
         "3": {"logprob": -0.5, "rank": 1, "decoded_token": "<3>"}},
        {"9": {"logprob": -0.25, "rank": 1, "decoded_token": "<9>"},
         "2": {"logprob": -1.75, "rank": 2, "decoded_token": "<2>"}}]
    # The prompt's own token first, as the engine orders it.
    assert [next(iter(p)) for p in json.loads(text)[1:]] == ["7", "9"]


def test_one_identical_text_per_sequence_and_none_once_sent_or_unasked():
    builder = LLMResponseBuilder(parsed({"prompt_logprobs": 1, "n": 3}))
    texts = builder.build(output(PROMPT_LOGPROBS, n=3))["prompt_logprobs"]
    assert texts.shape == (3,) and len(set(texts.tolist())) == 1
    # Later outputs of a stream carry none: the output is absent, not null.
    assert "prompt_logprobs" not in builder.build(output(None, n=3))
    assert "prompt_logprobs" not in LLMResponseBuilder(parsed({})).build(output(PROMPT_LOGPROBS))


def test_the_cap_counts_prompt_tokens_times_k_plus_one():
    check_prompt_logprobs_size(100, 9, 1000)  # exactly at the cap
    check_prompt_logprobs_size(10**6, 20, 0)  # 0: no cap
    check_prompt_logprobs_size(10**6, None, 10)  # not asked
    with pytest.raises(InvalidRequest) as error:
        check_prompt_logprobs_size(101, 9, 1000)
    assert all(f in str(error.value) for f in ("prompt_logprobs=9", "101-token", "1010",
                                               "MAX_PROMPT_LOGPROBS_ENTRIES=1000"))
    # Each of n's sequence entries carries a copy.
    check_prompt_logprobs_size(50, 9, 1000, n=2)
    with pytest.raises(InvalidRequest, match="x n=3 asks 1500"):
        check_prompt_logprobs_size(50, 9, 1000, n=3)


def test_the_cap_is_a_config_parameter():
    _, options = split_parameters({})
    assert options.max_prompt_logprobs_entries == 1_000_000
    _, options = split_parameters({"MAX_PROMPT_LOGPROBS_ENTRIES": "5000"})
    assert options.max_prompt_logprobs_entries == 5000
    with pytest.raises(ValueError, match="MAX_PROMPT_LOGPROBS_ENTRIES"):
        split_parameters({"MAX_PROMPT_LOGPROBS_ENTRIES": "-1"})


def test_the_output_is_auto_completed():
    config = complete_llm_config(ModelConfig({}))
    outputs = {e["name"]: e for e in config.as_dict()["output"]}
    assert outputs["prompt_logprobs"] == {"name": "prompt_logprobs", "data_type": "TYPE_STRING",
                                          "dims": [-1]}


def test_model_json_runner_arguments_reach_the_engine_config():
    assert parse_model_json({"runner": "pooling", "convert": "embed"}).engine_args == {
        "runner": "pooling", "convert": "embed"}
    assert parse_model_json({"task": "score"}).engine_args == {"task": "score"}
    with pytest.raises(ValueError, match="runner"):
        parse_model_json({"runner": "pool"})
