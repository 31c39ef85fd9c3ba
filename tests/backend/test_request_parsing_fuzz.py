"""Property tests of the request parsers: whatever a client sends, the `llm` and
`tensorrt_llm` parsers either accept it with every value in range or refuse it with
InvalidRequest (the backend's INVALID_ARG) naming a field; never another exception.
The tensors carry the dtypes config.pbtxt declares, as Triton delivers them; their
shapes and values are the client's. Bounded by max_examples to keep CI time small."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.config_params import split_parameters
from backend.llm_config import LLM_INPUTS, LLM_OUTPUTS, complete_llm_config
from backend.request_parsing import InvalidRequest, LLMRequest, parse_llm_request
from backend.token_request_parsing import TokenRequest, parse_token_request
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from tests.backend.test_llm_config import ModelConfig

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SAMPLING_NAMES = [f.name for f in dataclasses.fields(SamplingParams)]
SWITCHES = ["stream", "exclude_input_in_output", "return_finish_reason",
            "return_num_input_tokens", "return_num_output_tokens",
            "return_cumulative_logprob", "return_logprobs", "return_num_cached_tokens",
            "return_max_model_len"]
EXTRA_KEYS = ["priority", "lora_name", "add_special_tokens", "guided_decoding", "best_of",
              "use_beam_search", "length_penalty", "spaces_between_special_tokens"]
# Names an error may point at besides the keys the request itself sent.
INPUT_NAMES = ["text_input", "prompt_token_ids", "image", "sampling_parameters", "request parameters",
               "input_ids", "input_lengths", "request_output_len", "beam_width", "end_id",
               "bad_words", "stop_words_list", "seed", "random_seed", "streaming",
               "min_length", "temperature", "runtime_top_k", "runtime_top_p",
               *SAMPLING_NAMES, *SWITCHES, *EXTRA_KEYS]

edge_ints = st.sampled_from([0, 1, -1, 2**31 - 1, -2**31, 2**31, 2**63, -2**63, 2**64, 10**30])
numbers = st.one_of(st.integers(-5, 70), edge_ints,
                    st.floats(allow_nan=True, allow_infinity=True), st.booleans())
json_values = st.recursive(
    st.one_of(st.none(), numbers, st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)
# A value as JSON or as the string vllm_backend clients often send instead ("16").
client_values = st.one_of(json_values, json_values.map(json.dumps), numbers.map(str))
keys = st.one_of(st.sampled_from(SAMPLING_NAMES + SWITCHES + EXTRA_KEYS), st.text(max_size=10))
json_objects = st.dictionaries(keys, client_values, max_size=6)


def json_text(objects=json_objects):
    """JSON object text, plus what a client may garble: non-objects, bad JSON, bad UTF-8."""
    return st.one_of(objects.map(lambda o: json.dumps(o).encode()),
                     json_values.map(lambda v: json.dumps(v).encode()),
                     st.binary(max_size=24), st.just(b""))


def string_tensor(values, shapes=st.sampled_from([(1,), (1, 1), (2,), (0,)])):
    return st.tuples(values, shapes).map(
        lambda vs: np.array([vs[0]] * int(np.prod(vs[1])), dtype=np.object_).reshape(vs[1]))


def typed_tensor(dtype, elements, shapes=st.sampled_from([(1,), (1, 1), (2,)])):
    return st.tuples(st.lists(elements, min_size=2, max_size=2), shapes).map(
        lambda vs: np.array(vs[0][:1] * int(np.prod(vs[1])), dtype=dtype).reshape(vs[1]))


def optional(name, strategy):
    return st.one_of(st.none(), strategy).map(lambda v: {} if v is None else {name: v})


def merged(*parts):
    return st.tuples(*parts).map(lambda ds: {k: v for d in ds for k, v in d.items()})


int32 = st.integers(-2**31, 2**31 - 1)
# prompt_token_ids as Triton delivers it (INT64, dims [-1]): any length, any values.
id_tensors = st.lists(st.one_of(st.integers(-3, 120), st.sampled_from([-2**63, 2**63 - 1])),
                      max_size=6).map(lambda v: np.array(v, dtype=np.int64))
FUZZ_VOCAB = 100
llm_inputs = merged(
    optional("text_input", string_tensor(st.one_of(st.text(max_size=20).map(str.encode),
                                                   st.binary(max_size=8)))),
    optional("prompt_token_ids", id_tensors),
    optional("sampling_parameters", string_tensor(json_text(), st.just((1,)))),
    optional("image", string_tensor(st.binary(max_size=4), st.sampled_from([(0,), (1,)]))),
    optional("priority", typed_tensor(np.int32, int32)),
    *(optional(name, typed_tensor(np.bool_, st.booleans())) for name in SWITCHES))


def assert_names_a_field(error: InvalidRequest, sent) -> None:
    message = str(error)
    assert message and any(name and name in message for name in [*INPUT_NAMES, *sent]), message


def sent_keys(inputs, request_parameters) -> list[str]:
    names = list(inputs)
    for text in (request_parameters, *np.asarray(inputs.get("sampling_parameters", [])).ravel()):
        try:
            names += list(json.loads(text))
        except (ValueError, TypeError):
            pass
    return names


def assert_sampling_in_range(params: SamplingParams) -> None:
    # The engine's own validation accepts what the parser built, and the ranges the
    # sampler relies on hold.
    SamplingParams(**{f.name: getattr(params, f.name) for f in dataclasses.fields(params)})
    assert params.max_tokens is None or params.max_tokens >= 1
    assert params.temperature >= 0 and 0 < params.top_p <= 1 and params.top_k >= 0
    assert params.max_tokens is None or params.min_tokens <= params.max_tokens


@FUZZ
@given(inputs=llm_inputs, request_parameters=json_text())
def test_llm_requests_are_accepted_in_range_or_refused_naming_a_field(inputs, request_parameters):
    try:
        request = parse_llm_request(inputs, request_parameters, vocab_size=FUZZ_VOCAB)
    except InvalidRequest as error:
        assert_names_a_field(error, sent_keys(inputs, request_parameters))
        return
    assert isinstance(request, LLMRequest)
    # Exactly one prompt: text, or ids inside the vocabulary.
    if request.prompt_token_ids is None:
        assert isinstance(request.prompt, str)
    else:
        assert request.prompt is None and request.prompt_token_ids
        assert all(0 <= t < FUZZ_VOCAB for t in request.prompt_token_ids)
    assert_sampling_in_range(request.params)
    assert -2**31 <= request.priority < 2**31
    assert not (request.stream and not request.exclude_input_in_output)
    assert request.lora_name is None or (isinstance(request.lora_name, str) and request.lora_name)


@FUZZ
@given(inputs=llm_inputs.map(lambda d: {k: v for k, v in d.items() if k != "sampling_parameters"}),
       parameters=st.dictionaries(keys, st.one_of(numbers, st.text(max_size=8)), max_size=6))
def test_llm_request_parameters_of_http_generate(inputs, parameters):
    """HTTP generate's "parameters": Triton's typed values (bool, int, double, string)."""
    text = json.dumps(parameters)
    test_llm_requests_are_accepted_in_range_or_refused_naming_a_field.hypothesis.inner_test(
        {"text_input": np.array([b"hi"], dtype=np.object_), **inputs}, text)


batched = st.sampled_from([(1, 1), (1,), (2, 1)])
word_lists = st.tuples(st.lists(st.integers(-3, 9), min_size=1, max_size=6),
                       st.sampled_from([1, 2])).map(
    lambda t: np.array([t[0], t[0]] * t[1], dtype=np.int32).reshape(t[1], 2, len(t[0])))
token_inputs = merged(
    optional("input_ids", st.tuples(st.lists(int32, max_size=6), st.sampled_from([1, 2])).map(
        lambda t: np.array(t[0] * t[1], dtype=np.int32).reshape(t[1], len(t[0])))),
    optional("input_lengths", typed_tensor(np.int32, st.one_of(st.integers(-2, 8), int32),
                                           batched)),
    optional("request_output_len", typed_tensor(np.int32, st.one_of(st.integers(-2, 40), int32),
                                                batched)),
    optional("min_length", typed_tensor(np.int32, st.one_of(st.integers(-2, 40), int32), batched)),
    optional("beam_width", typed_tensor(np.int32, st.integers(-1, 3), batched)),
    optional("end_id", typed_tensor(np.int32, st.one_of(st.integers(-2, 5), int32), batched)),
    optional("pad_id", typed_tensor(np.int32, int32, batched)),
    optional("runtime_top_k", typed_tensor(np.int32, st.one_of(st.integers(-2, 50), int32),
                                           batched)),
    *(optional(name, typed_tensor(np.float32, st.floats(width=32), batched))
      for name in ("temperature", "runtime_top_p")),
    *(optional(name, typed_tensor(np.uint64, st.integers(0, 2**64 - 1), batched))
      for name in ("random_seed", "seed")),
    optional("streaming", typed_tensor(np.bool_, st.booleans(), batched)),
    optional("exclude_input_in_output", typed_tensor(np.bool_, st.booleans(), batched)),
    optional("priority", typed_tensor(np.int32, int32, batched)),
    optional("lora_name", string_tensor(st.one_of(st.text(max_size=6).map(str.encode),
                                                  st.binary(max_size=4)), batched)),
    optional("stop_words_list", word_lists),
    optional("bad_words_list", word_lists))


@FUZZ
@given(inputs=token_inputs)
def test_token_requests_are_accepted_in_range_or_refused_naming_a_field(inputs):
    try:
        request = parse_token_request(inputs)
    except InvalidRequest as error:
        assert_names_a_field(error, list(inputs))
        return
    assert isinstance(request, TokenRequest)
    assert request.prompt_token_ids and min(request.prompt_token_ids) >= 0
    assert_sampling_in_range(request.params)
    assert -2**31 <= request.priority < 2**31


# --- load time: the llm model's auto-complete and its config.pbtxt parameters ---------

LLM_TENSORS = [spec["name"] for spec in LLM_INPUTS + LLM_OUTPUTS]
tensor_specs = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(LLM_TENSORS), st.text(min_size=1, max_size=6)),
     "data_type": st.sampled_from(["TYPE_STRING", "TYPE_BOOL", "TYPE_INT32", "TYPE_FP32"]),
     "dims": st.lists(st.integers(-1, 4), min_size=1, max_size=2)})


@FUZZ
@given(declared_inputs=st.lists(tensor_specs, max_size=5, unique_by=lambda s: s["name"]),
       declared_outputs=st.lists(tensor_specs, max_size=5, unique_by=lambda s: s["name"]))
def test_auto_complete_keeps_what_is_declared_and_adds_the_rest(declared_inputs, declared_outputs):
    config = complete_llm_config(ModelConfig(
        {"input": [dict(s) for s in declared_inputs],
         "output": [dict(s) for s in declared_outputs]})).as_dict()
    for section, declared, specs in (("input", declared_inputs, LLM_INPUTS),
                                     ("output", declared_outputs, LLM_OUTPUTS)):
        names = [s["name"] for s in config[section]]
        assert len(names) == len(set(names))  # never a tensor twice, which Triton refuses
        assert config[section][:len(declared)] == declared
        assert {s["name"] for s in specs} <= set(names)
    assert config["model_transaction_policy"] == {"decoupled": True}
    assert config["max_batch_size"] == 0


ENGINE_ARGS = sorted(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model")
BACKEND_PARAMETERS = ["REPORT_CUSTOM_METRICS", "DRAIN_TIMEOUT_S", "MAX_QUEUE_LEN",
                      "ENABLE_VLLM_HEALTH_CHECK"]
parameter_values = st.one_of(numbers.map(str), st.sampled_from(["", "true", "off", "fcfs", "1e3"]),
                             st.text(max_size=8))


@FUZZ
@given(params=st.dictionaries(
    st.one_of(st.sampled_from(ENGINE_ARGS + BACKEND_PARAMETERS), st.text(min_size=1, max_size=8)),
    parameter_values, max_size=5))
def test_config_parameters_load_or_fail_naming_the_parameter(params):
    try:
        config, options = split_parameters(params)
    except ValueError as error:
        assert any(key in str(error) or repr(key) in str(error) for key in params), str(error)
        return
    assert isinstance(config, EngineConfig)
    assert options.max_queue_len >= 0 and options.drain_timeout_s >= 0
