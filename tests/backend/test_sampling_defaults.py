"""The model's generation_config sampling defaults on the Triton models (engine/config/
generation.py owns them; the backend parsers apply them): on `llm` a key the request gives
wins and an absent one takes the model's value, the OpenAI route sends only what its client
set, the token-id model keeps TensorRT-LLM's greedy rule, and generation_config /
override_generation_config arrive from model.json and config.pbtxt."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend.config_params import split_parameters
from backend.model_json import parse_model_json
from backend.request_parsing import InvalidRequest, parse_llm_request
from backend.token_request_parsing import parse_token_request
from engine.config.generation import SamplingDefaults
from openai_frontend.mapping import chat_request, completion_request
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest

# Qwen3's recommended values, and a repetition penalty.
MODEL = SamplingDefaults({"temperature": 0.6, "top_k": 20, "top_p": 0.95,
                          "repetition_penalty": 1.05})


def llm_inputs(sampling: dict | None = None) -> dict:
    out = {"text_input": np.array([b"hi"], dtype=np.object_)}
    if sampling is not None:
        out["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=np.object_)
    return out


def params_of(sampling, defaults=MODEL):
    return parse_llm_request(llm_inputs(sampling), defaults=defaults).params


def test_llm_absent_keys_take_the_models_values_and_given_ones_win():
    p = params_of({"max_tokens": 8})
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.6, 20, 0.95, 1.05)
    assert p.max_tokens == 8 and p.min_p == 0.0  # min_p: not in the file, vLLM's own
    p = params_of({"temperature": 0, "top_k": "-1", "repetition_penalty": "1.0"})
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.0, 0, 0.95, 1.0)
    # No JSON at all (request parameters only): every default.
    assert parse_llm_request(llm_inputs(), "", MODEL).params.temperature == 0.6


def test_llm_without_defaults_keeps_vllms():
    for defaults in (None, SamplingDefaults()):
        p = params_of({}, defaults)
        assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.max_tokens) == \
            (1.0, 0, 1.0, 1.0, 16)


def test_llm_max_tokens_default_and_ceiling():
    with_max = SamplingDefaults({"max_tokens": 100})
    assert params_of({}, with_max).max_tokens == 100
    # null: vLLM's "unset" (what the OpenAI route sends for chat without a limit).
    assert params_of({"max_tokens": None}, with_max).max_tokens == 100
    assert params_of({"max_tokens": None}).max_tokens is None  # none: up to the context
    assert params_of({"max_tokens": 500}, with_max).max_tokens == 500
    capped = SamplingDefaults({"max_tokens": 100}, max_tokens_cap=100)
    assert params_of({"max_tokens": 500}, capped).max_tokens == 100
    assert params_of({"max_tokens": None}, capped).max_tokens == 100


def test_a_request_the_defaults_make_invalid_names_the_field():
    with pytest.raises(InvalidRequest, match="min_tokens"):
        params_of({"min_tokens": 50}, SamplingDefaults({"max_tokens": 10}, max_tokens_cap=10))


def test_the_openai_route_sends_only_what_its_client_set():
    """So the `llm` model's defaults fill the rest: no temperature=1.0 rides along."""
    chat = chat_request(ChatCompletionRequest(model="m", messages=[{"role": "user",
                                                                    "content": "x"}]), "P")
    p = params_of(chat.sampling)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.6, 20, 0.95, 1.05)
    assert p.max_tokens is None  # chat: until the model stops
    chat = chat_request(ChatCompletionRequest(model="m", temperature=0.2, top_p=1.0,
                                              messages=[{"role": "user", "content": "x"}]), "P")
    p = params_of(chat.sampling)
    assert (p.temperature, p.top_k, p.top_p) == (0.2, 20, 1.0)
    completion = completion_request(CompletionRequest(model="m", prompt="x"))
    p = params_of(completion.sampling, SamplingDefaults({"temperature": 0.6, "max_tokens": 300}))
    assert (p.temperature, p.max_tokens) == (0.6, 16)  # OpenAI's completion default, as vLLM


def token_inputs(**extra):
    out = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32),
           "request_output_len": np.array([[8]], dtype=np.int32)}
    out.update({k: np.array([[v]]) for k, v in extra.items()})
    return out


def test_token_model_stays_greedy_unless_asked_and_takes_the_models_penalties():
    p = parse_token_request(token_inputs(), MODEL).params
    assert (p.temperature, p.top_k, p.top_p) == (0.0, 0, 1.0)  # TensorRT-LLM's greedy
    assert p.repetition_penalty == 1.05
    # Sampling (top_k > 1 or top_p > 0): the knobs it leaves out take the model's values.
    p = parse_token_request(token_inputs(runtime_top_k=np.int32(5)), MODEL).params
    assert (p.temperature, p.top_k, p.top_p) == (0.6, 5, 0.95)
    p = parse_token_request(token_inputs(runtime_top_p=np.float32(0.5),
                                         temperature=np.float32(0.9)), MODEL).params
    assert (p.temperature, p.top_k, p.top_p) == (pytest.approx(0.9), 20, 0.5)
    # request_output_len is required, so max_tokens is always the request's (under a ceiling).
    capped = SamplingDefaults(max_tokens_cap=4)
    assert parse_token_request(token_inputs(), capped).params.max_tokens == 4
    # Without defaults, as before.
    p = parse_token_request(token_inputs(runtime_top_k=np.int32(5))).params
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (1.0, 5, 1.0, 1.0)


def test_engine_arguments_from_model_json_and_config_pbtxt(tmp_path):
    parsed = parse_model_json({"generation_config": "vllm",
                               "override_generation_config": {"temperature": 0.5}})
    assert parsed.engine_args == {"generation_config": "vllm",
                                  "override_generation_config": {"temperature": 0.5}}
    config, _ = split_parameters({"override_generation_config": '{"top_k": 3}'}, parsed)
    assert config.generation_config == "vllm"
    assert config.override_generation_config == {"top_k": 3}  # config.pbtxt wins
    config, _ = split_parameters({"generation_config": str(tmp_path)})
    assert config.generation_config == str(tmp_path)
    assert split_parameters({})[0].generation_config == "auto"
    with pytest.raises(ValueError, match="model.json key 'generation_config'"):
        parse_model_json({"generation_config": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match="model.json key 'override_generation_config'"):
        parse_model_json({"override_generation_config": [1]})
