"""The `llm` model's id prompts without a server (issue 47): `prompt_token_ids` instead of
`text_input`, exactly one of them; ids checked against the engine's vocabulary, its length
against max_model_len; the cached-token and max_model_len outputs; and a request that
asks only for max_model_len. The real server's side is tests/e2e/test_token_prompts.py."""
from __future__ import annotations

import numpy as np
import pytest

from backend.llm_config import complete_llm_config
from backend.llm_responses import LLMResponseBuilder
from backend.prompt_limits import check_prompt_ids_length
from backend.request_parsing import InvalidRequest, asks_limits_only, parse_llm_request
from engine.api import CompletionOutput, RequestOutput
from tests.backend.test_llm_config import ModelConfig

VOCAB = 100


def ids(*values, dtype=np.int64):
    return {"prompt_token_ids": np.array(values, dtype=dtype)}


def text(prompt="hi"):
    return {"text_input": np.array([prompt.encode()], dtype=np.object_)}


def refused(inputs, *fragments, vocab_size=VOCAB):
    with pytest.raises(InvalidRequest) as error:
        parse_llm_request(inputs, vocab_size=vocab_size)
    assert all(f in str(error.value) for f in fragments), str(error.value)


def test_an_id_prompt_is_taken_as_python_ints_and_a_text_prompt_as_before():
    request = parse_llm_request(ids(1, 0, VOCAB - 1), vocab_size=VOCAB)
    assert request.prompt is None and request.prompt_token_ids == [1, 0, VOCAB - 1]
    assert all(type(t) is int for t in request.prompt_token_ids)
    assert parse_llm_request({"prompt_token_ids": np.array([[5, 6]], np.int64)}).prompt_token_ids == [5, 6]
    request = parse_llm_request(text("hello"), vocab_size=VOCAB)
    assert request.prompt == "hello" and request.prompt_token_ids is None


def test_exactly_one_of_text_input_and_prompt_token_ids():
    refused({}, "text_input", "prompt_token_ids")
    refused({**text(), **ids(1)}, "text_input", "prompt_token_ids", "not both")


@pytest.mark.parametrize("inputs,fragments", [
    (ids(), ["prompt_token_ids must not be empty"]),
    (ids(1, -1, 2, -7), ["prompt_token_ids", "[0, 100)", "2 are not", "[-1, -7]"]),
    (ids(VOCAB), ["prompt_token_ids", "[0, 100)", "[100]"]),
    (ids(3, 2**40, dtype=np.uint64), ["prompt_token_ids", "[1099511627776]"]),
    (ids(1.0, 2.0, dtype=np.float32), ["prompt_token_ids", "INT64", "float32"]),
    (ids(True, dtype=np.bool_), ["prompt_token_ids", "INT64", "bool"]),
    ({"prompt_token_ids": np.array([b"1"], dtype=np.object_)}, ["prompt_token_ids", "INT64"]),
    ({"prompt_token_ids": np.array([[1, 2], [3, 4]], np.int64)}, ["prompt_token_ids", "[2, 2]"]),
    ({"prompt_token_ids": np.array(5, np.int64)}, ["prompt_token_ids", "shape []"]),
])
def test_bad_id_prompts_are_refused_naming_the_field(inputs, fragments):
    refused(inputs, *fragments)


def test_without_the_engines_vocabulary_only_negative_ids_are_refused():
    assert parse_llm_request(ids(10**9)).prompt_token_ids == [10**9]
    refused(ids(-1), "non-negative", vocab_size=None)


def test_an_id_prompt_of_max_model_len_leaves_no_room_for_output():
    check_prompt_ids_length(None, 8)
    check_prompt_ids_length(np.arange(7), 8)  # max_model_len - 1: room for one token
    for length in (8, 9):
        with pytest.raises(InvalidRequest, match=rf"prompt_token_ids is {length} ids long.*max_model_len=8"):
            check_prompt_ids_length(np.arange(length), 8)


def test_a_request_asking_only_max_model_len_needs_no_prompt():
    ask = {"return_max_model_len": np.array([True])}
    assert asks_limits_only(ask)
    assert asks_limits_only({}, '{"return_max_model_len": true}')  # HTTP generate's parameters
    assert not asks_limits_only({"return_max_model_len": np.array([False])})
    assert not asks_limits_only({**ask, **ids(1)}) and not asks_limits_only({**ask, **text()})
    refused({"return_max_model_len": np.array([False])}, "text_input", "prompt_token_ids")


def test_the_cached_tokens_and_max_model_len_outputs_and_an_id_prompts_text():
    request = parse_llm_request({**ids(7, 8), "exclude_input_in_output": np.array([False]),
                                 "return_num_cached_tokens": np.array([True]),
                                 "return_max_model_len": np.array([True])})
    builder = LLMResponseBuilder(request, prompt_text="<s> Hello", max_model_len=512)
    out = RequestOutput("r", None, [7, 8], [CompletionOutput(0, " world", [9], finish_reason="length")],
                        True, num_cached_tokens=16)
    tensors = builder.build(out)
    # exclude_input_in_output false: the detokenized id prompt before the text.
    assert tensors["text_output"][0] == b"<s> Hello world"
    assert tensors["num_cached_tokens"].dtype == np.uint32 and int(tensors["num_cached_tokens"][0]) == 16
    assert int(tensors["max_model_len"][0]) == 512
    plain = LLMResponseBuilder(parse_llm_request(ids(7, 8))).build(out)
    assert "num_cached_tokens" not in plain and "max_model_len" not in plain


def test_auto_complete_declares_the_new_tensors_and_makes_text_input_optional():
    config = complete_llm_config(ModelConfig({})).as_dict()
    inputs = {spec["name"]: spec for spec in config["input"]}
    outputs = {spec["name"]: spec for spec in config["output"]}
    assert inputs["prompt_token_ids"] == {"name": "prompt_token_ids", "data_type": "TYPE_INT64",
                                          "dims": [-1], "optional": True}
    assert inputs["text_input"]["optional"] is True
    for switch in ("return_num_cached_tokens", "return_max_model_len"):
        assert inputs[switch] == {"name": switch, "data_type": "TYPE_BOOL", "dims": [1],
                                  "optional": True}
    for name in ("num_cached_tokens", "max_model_len"):
        assert outputs[name] == {"name": name, "data_type": "TYPE_UINT32", "dims": [1]}
