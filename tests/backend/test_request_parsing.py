"""backend.request_parsing: the llm model's request rules, without a server."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from backend.request_parsing import (InvalidRequest, compile_structured_output, parse_llm_request,
                                     parse_sampling_parameters, load_json_object)
from engine.sampling_params import RequestOutputKind
from engine.structured_output.grammar import GrammarCompiler


def tensors(prompt="hi", sampling=None, **flags):
    out = {"text_input": np.array([prompt.encode()], dtype=np.object_)}
    if sampling is not None:
        text = sampling if isinstance(sampling, str) else json.dumps(sampling)
        out["sampling_parameters"] = np.array([text.encode()], dtype=np.object_)
    for name, value in flags.items():
        out[name] = np.array([value], dtype=np.bool_)
    return out


def test_string_values_are_converted():
    p = parse_sampling_parameters({"max_tokens": "32", "min_tokens": "32", "temperature": "0.5",
                                   "top_k": "-1", "ignore_eos": "false", "stop": '["a", "b"]',
                                   "stop_token_ids": "[2, 3]", "seed": "7", "logprobs": "null"})
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_k, p.ignore_eos) == (32, 32, 0.5, 0, False)
    assert p.stop == ["a", "b"] and p.stop_token_ids == [2, 3] and p.seed == 7 and p.logprobs is None


def test_typed_values_and_single_stop_string():
    p = parse_sampling_parameters({"max_tokens": 8, "temperature": 0, "ignore_eos": True, "stop": "\n"})
    assert (p.max_tokens, p.temperature, p.ignore_eos, p.stop) == (8, 0.0, True, ["\n"])


@pytest.mark.parametrize("params,fragment", [
    ({"max_tokenz": 3}, "max_tokenz"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": "1.5"}, "top_p"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"ignore_eos": "maybe"}, "ignore_eos"),
    ({"best_of": 2}, "'best_of'"),
    ({"n": 0}, "SamplingParams.n "),
    ({"use_beam_search": "true"}, "use_beam_search"),
    ({"stop": [1]}, "stop"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
])
def test_bad_values_name_the_field(params, fragment):
    with pytest.raises(InvalidRequest, match=fragment):
        parse_sampling_parameters(params)


def test_vllm_defaults_accepted_at_their_neutral_value():
    assert parse_sampling_parameters({"n": "1", "best_of": 1, "use_beam_search": False}).max_tokens == 16


def test_defaults_follow_vllm_backend():
    r = parse_llm_request(tensors())
    assert not r.stream and not r.exclude_input_in_output and r.params.max_tokens == 16
    r = parse_llm_request(tensors(stream=True))
    assert r.stream and r.exclude_input_in_output


def test_the_stream_switch_sets_the_output_kind_and_clients_cannot():
    # The engine then decides what is sent when (stream_interval); the responses translate.
    assert parse_llm_request(tensors(stream=True)).params.output_kind is RequestOutputKind.DELTA
    assert parse_llm_request(tensors()).params.output_kind is RequestOutputKind.FINAL_ONLY
    r = parse_llm_request(tensors(), json.dumps({"stream": True, "max_tokens": 4}))
    assert r.params.output_kind is RequestOutputKind.DELTA
    with pytest.raises(InvalidRequest, match="unknown sampling parameter 'output_kind'"):
        parse_sampling_parameters({"output_kind": 0})


def test_streaming_with_prompt_prepended_is_an_error():
    """Mirrors vllm_backend's L0_backend_vllm/enabled_stream
    test_vllm_model_enabled_stream_exclude_input_in_output_false, which compares the
    message whole."""
    with pytest.raises(InvalidRequest) as refused:
        parse_llm_request(tensors(stream=True, exclude_input_in_output=False))
    assert str(refused.value) == ("Error generating stream: When streaming, "
                                  "`exclude_input_in_output` = False is not allowed.")


@pytest.mark.parametrize("where,make", [
    ("text_input", lambda: {"text_input": np.array(["a\ud800b"], dtype=np.object_)}),
    ("stop[1]", lambda: tensors(sampling='{"stop": ["ok", "\\ud800"]}')),
    ("stop", lambda: tensors(sampling='{"stop": "x\\udfffy"}')),
    ("structured_outputs.choice[0]",
     lambda: tensors(sampling='{"structured_outputs": {"choice": ["\\udc00"]}}')),
    ("key", lambda: tensors(sampling='{"\\ud800": 1}')),
])
def test_lone_surrogates_are_the_clients_error_naming_where(where, make):
    """JSON's \\ud800 escape parses to a lone surrogate, which no tokenizer or stop
    matcher takes: INVALID_ARG naming where it is, not an internal error later."""
    with pytest.raises(InvalidRequest, match="lone surrogate") as refused:
        parse_llm_request(make())
    assert where in str(refused.value)


def test_lone_surrogates_in_request_parameters_and_paired_ones_pass():
    with pytest.raises(InvalidRequest, match=r"request parameters: stop holds a lone surrogate"):
        parse_llm_request(tensors(), '{"stop": "\\ud83d"}')
    # A pair is one character (U+1F600), text like any other.
    assert parse_llm_request(tensors(), '{"stop": "\\ud83d\\ude00"}').params.stop == ["\U0001F600"]


def test_return_logprobs_without_a_logprobs_parameter_gives_null():
    """Mirrors vllm_backend's L0_additional_outputs_vllm test_additional_outputs (logprobs
    None, return_logprobs True): vLLM hands no logprobs and vllm_backend sends null; the
    sampled token's logprob was sent instead."""
    from backend.llm_responses import LLMResponseBuilder
    from engine.outputs import CompletionOutput, Logprob, RequestOutput

    out = RequestOutput("r", None, [1, 2], [CompletionOutput(
        0, " a", [5], cumulative_logprob=-0.5, logprobs=[{5: Logprob(-0.5, 1)}],
        finish_reason="length")], True)
    bare = parse_llm_request(tensors(return_logprobs=True, return_cumulative_logprob=True))
    assert not bare.logprobs_asked and bare.params.logprobs == 0  # still computed (cumulative)
    built = LLMResponseBuilder(bare).build(out)
    assert json.loads(built["logprobs"][0]) is None
    assert built["cumulative_logprob"][0] == np.float32(-0.5)
    asked = parse_llm_request(tensors(sampling={"logprobs": 0}, return_logprobs=True))
    assert json.loads(LLMResponseBuilder(asked).build(out)["logprobs"][0]) == [
        {"5": {"logprob": -0.5, "rank": 1}}]
    explicit_null = parse_llm_request(tensors(sampling={"logprobs": None}, return_logprobs=True))
    assert json.loads(LLMResponseBuilder(explicit_null).build(out)["logprobs"][0]) is None


def test_request_parameters_fallback_and_switches():
    r = parse_llm_request(tensors(), json.dumps({"max_tokens": 5, "temperature": 0, "stream": True,
                                                 "return_finish_reason": "true"}))
    assert r.params.max_tokens == 5 and r.stream and r.exclude_input_in_output and r.returns.finish_reason


def test_sampling_parameters_input_wins_over_request_parameters():
    r = parse_llm_request(tensors(sampling={"max_tokens": 3}), json.dumps({"max_tokens": 9}))
    assert r.params.max_tokens == 3


def test_input_tensor_wins_over_parameter_switch():
    r = parse_llm_request(tensors(stream=False), json.dumps({"stream": True}))
    assert not r.stream


@pytest.mark.parametrize("raw,fragment", [("{oops", "not valid JSON"), ("[1]", "JSON object"),
                                          (b"\xff", "UTF-8")])
def test_bad_sampling_json(raw, fragment):
    t = tensors()
    t["sampling_parameters"] = np.array([raw if isinstance(raw, bytes) else raw.encode()], dtype=np.object_)
    with pytest.raises(InvalidRequest, match=fragment):
        parse_llm_request(t)


def test_prompt_checks():
    with pytest.raises(InvalidRequest, match="text_input"):
        parse_llm_request({})
    with pytest.raises(InvalidRequest, match="UTF-8"):
        parse_llm_request({"text_input": np.array([b"\xc3"], dtype=np.object_)})
    with pytest.raises(InvalidRequest, match="exactly one"):
        parse_llm_request({"text_input": np.array([b"a", b"b"], dtype=np.object_)})


def test_logprob_outputs_imply_sampled_logprobs():
    r = parse_llm_request(tensors(return_cumulative_logprob=True))
    assert r.params.logprobs == 0
    r = parse_llm_request(tensors(sampling={"logprobs": 3}, return_logprobs=True))
    assert r.params.logprobs == 3


def test_priority_from_sampling_parameters_request_parameters_or_input():
    assert parse_llm_request(tensors()).priority == 0
    assert parse_llm_request(tensors(sampling={"priority": -3, "max_tokens": 2})).priority == -3
    assert parse_llm_request(tensors(sampling={"priority": "7"})).priority == 7
    assert parse_llm_request(tensors(), json.dumps({"priority": 5, "max_tokens": 2})).priority == 5
    # The INT32 input wins over the JSON key.
    inputs = {**tensors(sampling={"priority": 9}), "priority": np.array([1], dtype=np.int32)}
    assert parse_llm_request(inputs).priority == 1


@pytest.mark.parametrize("value", [1.5, "high", True, 2**31, None])
def test_bad_priority_is_named(value):
    with pytest.raises(InvalidRequest, match="priority"):
        parse_llm_request(tensors(sampling={"priority": value}))


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("key", ["structured_outputs", "guided_decoding"])
@pytest.mark.parametrize("as_text", [False, True], ids=["object", "json_text"])
def test_structured_outputs_under_either_key_as_object_or_text(key, as_text):
    spec = {"json": SCHEMA, "disable_any_whitespace": True}
    r = parse_llm_request(tensors(sampling={key: json.dumps(spec) if as_text else spec,
                                            "max_tokens": 9}))
    so = r.params.structured_outputs
    assert so.kind == "json" and so.json == SCHEMA and so.disable_any_whitespace
    for spec, kind in (({"regex": "[0-9]+"}, "regex"), ({"choice": ["a", "b"]}, "choice"),
                       ({"grammar": 'root ::= "x"'}, "grammar"), ({"json_object": True}, "json_object")):
        assert parse_sampling_parameters({key: spec}).structured_outputs.kind == kind


def test_triton_openai_frontend_guided_decoding_is_accepted():
    # What the frontend sends for tool_choice: vLLM's whole GuidedDecodingParams, as JSON text.
    sent = {"json": SCHEMA, "regex": None, "choice": None, "grammar": None, "json_object": None,
            "backend": None, "backend_was_auto": False, "disable_fallback": False,
            "disable_any_whitespace": False, "disable_additional_properties": False,
            "whitespace_pattern": None, "structural_tag": None}
    p = parse_sampling_parameters({"guided_decoding": json.dumps(sent), "max_tokens": 4})
    assert p.structured_outputs.json == SCHEMA
    assert parse_sampling_parameters({"guided_decoding": None}).structured_outputs is None


@pytest.mark.parametrize("sampling,fragment", [
    ({"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "a"}}, "not both"),
    ({"guided_decoding": {"regex": "a", "choice": ["a"]}}, "guided_decoding needs exactly one"),
    ({"guided_decoding": {"regx": "a"}}, "guided_decoding.regx"),
    ({"structured_outputs": "{bad"}, "structured_outputs is not valid JSON"),
    ({"structured_outputs": ["a"]}, "structured_outputs must be a JSON object"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs.choice"),
    ({"guided_decoding": {"regex": "a", "backend": "outlines"}}, "guided_decoding.backend"),
])
def test_malformed_structured_outputs_are_invalid_arg_naming_the_field(sampling, fragment):
    with pytest.raises(InvalidRequest, match=re.escape(fragment)):
        parse_llm_request(tensors(sampling=sampling))


def test_an_invalid_schema_is_invalid_arg_before_the_engine():
    from engine.models import load_tokenizer
    compiler = GrammarCompiler(load_tokenizer(None), 49152, (2,))
    for spec, field in (({"json": {"type": "nonsense"}}, "structured_outputs.json"),
                        ({"regex": "(a"}, "structured_outputs.regex"),
                        ({"grammar": "root ::= "}, "structured_outputs.grammar")):
        params = parse_sampling_parameters({"guided_decoding": spec})
        with pytest.raises(InvalidRequest, match=re.escape(field)):
            compile_structured_output(compiler, params)
    compile_structured_output(compiler, parse_sampling_parameters({"max_tokens": 3}))
    compile_structured_output(compiler, parse_sampling_parameters({"guided_decoding": {"json": SCHEMA}}))


def test_an_image_is_refused_as_text_only_and_an_empty_one_is_none():
    inputs = {**tensors(), "image": np.array([b"aGVsbG8="], dtype=np.object_)}
    with pytest.raises(InvalidRequest, match="text only.*'image'"):
        parse_llm_request(inputs)
    # vllm_backend sends no multi_modal_data for an empty tensor; nor is it an error here.
    empty = {**tensors(), "image": np.array([], dtype=np.object_)}
    assert parse_llm_request(empty).prompt == "hi"


def test_tenant_comes_from_sampling_or_request_parameters_and_is_checked():
    assert parse_llm_request(tensors(sampling={"tenant": "acme"})).tenant == "acme"
    assert parse_llm_request(tensors(), json.dumps({"tenant": "b", "max_tokens": 2})).tenant == "b"
    assert parse_llm_request(tensors()).tenant is None
    for bad in (5, "", "x" * 129, "tab\there"):
        with pytest.raises(InvalidRequest, match="tenant must be a non-empty printable string"):
            parse_llm_request(tensors(sampling={"tenant": bad}))


def test_stop_token_sequences_from_json_are_converted_or_refused_naming_the_field():
    # Found by tests/backend/test_request_parsing_fuzz.py: the field had no converter,
    # so any value raised TypeError instead of INVALID_ARG.
    assert parse_sampling_parameters({"stop_token_sequences": [[1, 2], [3]]}).stop_token_sequences \
        == [[1, 2], [3]]
    text = parse_sampling_parameters({"stop_token_sequences": "[[4]]"})
    assert text.stop_token_sequences == [[4]]
    for bad in (0, [1, 2], [["x"]], "[[1]", [[]]):
        with pytest.raises(InvalidRequest, match="stop_token_sequences"):
            parse_sampling_parameters({"stop_token_sequences": bad})


@pytest.mark.parametrize("depth", [5_000, 200_000])
def test_json_nested_past_the_parsers_reach_is_invalid_not_an_internal_error(depth):
    """A schema sent as a nested object (not as text) ~1,000 deep hit Python's recursion
    limit, which surfaced as 'could not parse request: maximum recursion depth ...'."""
    text = '{"structured_outputs": {"json": ' + '{"a":' * depth + "1" + "}" * depth + "}}"
    with pytest.raises(InvalidRequest, match="sampling_parameters nests too deeply to parse"):
        load_json_object("sampling_parameters", text)
