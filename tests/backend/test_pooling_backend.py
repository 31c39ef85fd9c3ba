"""A pooling model behind `llm` without a server (issue 47): vllm_backend's
`embedding_request` parsed and refused naming the field, the one response it gets, and
a real pooling engine (a tiny random BERT) driven by the backend's engine loop, its
vectors equal to the offline engine's and its metrics counting prompt tokens only. The
real server's side is tests/e2e/test_pooling_triton.py."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from backend.inflight import Inflight, record_timings
from backend.metrics import StepMetrics
from backend.pooling_request import TRUNCATED_TEXT_FACTOR, parse_pooling_request
from backend.pooling_responses import PoolingResponseBuilder
from backend.request_parsing import InvalidRequest
from engine.api import PoolingOutput, PoolingParams, PoolingRequestOutput
from tests.backend.test_engine_loop import Sender, wait_all
from testing.encoder_folders import make_encoder_dir

VOCAB = 100


def request(body, **tensors):
    text = body if isinstance(body, str) else json.dumps(body)
    inputs = {"embedding_request": np.array([text.encode()], dtype=np.object_)}
    for name, value in tensors.items():
        inputs[name] = np.array([value])
    return inputs


def refused(inputs, *fragments, parameters="", max_model_len=None):
    with pytest.raises(InvalidRequest) as error:
        parse_pooling_request(inputs, parameters, VOCAB, max_model_len)
    assert all(f in str(error.value) for f in fragments), str(error.value)


def test_inputs_as_vllm_backend_sends_them_and_ours():
    parsed = parse_pooling_request(request({"input": "hello"}), vocab_size=VOCAB)
    assert parsed.prompt == "hello" and parsed.params == PoolingParams() and not parsed.returns
    parsed = parse_pooling_request(request({"input": [3, 0, 99]}), vocab_size=VOCAB)
    assert parsed.prompt == [3, 0, 99] and all(type(t) is int for t in parsed.prompt)
    assert parse_pooling_request(request({"input": ["q", "d"]})).prompt == ("q", "d")
    # vllm_backend's dimensions list (it reads [0]), a plain integer, or a string value.
    for dims in ([8], 8, "8"):
        parsed = parse_pooling_request(request({"input": "x", "pooling_params": {"dimensions": dims}}))
        assert parsed.params.dimensions == 8
    options = {"truncate_prompt_tokens": -1, "use_activation": "false"}
    parsed = parse_pooling_request(request({"input": "x", "pooling_params": options}))
    assert parsed.params == PoolingParams(truncate_prompt_tokens=-1, use_activation=False)


def test_switches_and_priority_from_tensors_or_request_parameters():
    parsed = parse_pooling_request(request({"input": "x"}, return_num_input_tokens=True,
                                           return_finish_reason=False),
                                   json.dumps({"return_num_output_tokens": "true", "priority": 3}))
    assert parsed.returns == {"return_num_input_tokens", "return_num_output_tokens"}
    assert parsed.priority == 3
    inputs = request({"input": "x"})
    inputs["priority"] = np.array([-2], dtype=np.int32)
    assert parse_pooling_request(inputs, json.dumps({"priority": 3})).priority == -2


@pytest.mark.parametrize("inputs, fragments", [
    (request("{nope"), ["embedding_request is not valid JSON"]),
    (request("[1, 2]"), ["embedding_request must be a JSON object"]),
    (request({"prompt": "x"}), ["unknown keys ['prompt']"]),
    (request({"pooling_params": {}}), ["embedding_request.input is missing"]),
    (request({"input": ""}), ["embedding_request.input is empty"]),
    (request({"input": []}), ["embedding_request.input", "an empty list"]),
    (request({"input": 5}), ["embedding_request.input", "int"]),
    (request({"input": [1, VOCAB]}), ["embedding_request.input", "vocabulary [0, 100)", "[100]"]),
    (request({"input": [1, -1]}), ["embedding_request.input", "[-1]"]),
    (request({"input": [1, "a"]}), ["embedding_request.input", "token ids"]),
    (request({"input": [1, 2**70]}), ["embedding_request.input", "64 bits"]),
    (request({"input": ["a", "b", "c"]}), ["pair", "3 texts"]),
    (request({"input": ["a", ""]}), ["pair", "non-empty"]),
    (request({"input": "x", "pooling_params": [8]}), ["pooling_params must be a JSON object"]),
    (request({"input": "x", "pooling_params": {"dimensions": [8, 16]}}), ["dimensions", "[8, 16]"]),
    (request({"input": "x", "pooling_params": {"dimensions": 0}}), ["dimensions", ">= 1"]),
    (request({"input": "x", "pooling_params": {"max_tokens": 4}}), ["max_tokens", "not accepted"]),
    (request({"input": "x", "pooling_params": {"truncate_prompt_tokens": 0}}),
     ["truncate_prompt_tokens"]),
    ({**request({"input": "x"}), "text_input": np.array([b"y"], dtype=np.object_)},
     ["text_input", "embedding_request alone"]),
    ({**request({"input": "x"}), "sampling_parameters": np.array([b"{}"], dtype=np.object_)},
     ["sampling_parameters"]),
    ({}, ["missing embedding_request"]),
])
def test_bad_requests_are_refused_naming_the_field(inputs, fragments):
    refused(inputs, *fragments)


def test_generation_keys_in_request_parameters_are_refused_naming_them():
    refused(request({"input": "x"}), "['max_tokens']", "pooling_params",
            parameters=json.dumps({"max_tokens": 4}))


def test_an_id_list_over_max_model_len_is_refused_unless_truncated():
    ids = {"input": list(range(10))}
    refused(request(ids), "10 token ids", "max_model_len=8", "truncate_prompt_tokens",
            max_model_len=8)
    truncated = {**ids, "pooling_params": {"truncate_prompt_tokens": 8}}
    assert parse_pooling_request(request(truncated), "", VOCAB, 8).prompt == list(range(10))


def test_texts_over_what_could_fit_are_refused_before_the_engine_tokenizes_them():
    """Each text of the input (both of a pair) against the byte bound; under truncation
    TRUNCATED_TEXT_FACTOR times it, never without end (the engine thread tokenizes it)."""
    limit = 100
    fits, over = "a" * limit, "a" * (limit + 1)
    assert parse_pooling_request(request({"input": fits}), "", VOCAB, 8, limit).prompt == fits
    for body in ({"input": over}, {"input": [fits, over]}):
        with pytest.raises(InvalidRequest, match="101 bytes, more than 100 bytes"):
            parse_pooling_request(request(body), "", VOCAB, 8, limit)
    cut = {"pooling_params": {"truncate_prompt_tokens": 8}}
    long = "a" * (limit * TRUNCATED_TEXT_FACTOR)
    assert parse_pooling_request(request({"input": long, **cut}), "", VOCAB, 8, limit).prompt == long
    with pytest.raises(InvalidRequest, match="the most taken for truncation"):
        parse_pooling_request(request({"input": long + "a", **cut}), "", VOCAB, 8, limit)


def test_the_response_is_the_vector_as_json_and_the_counts_asked():
    out = PoolingRequestOutput("r", PoolingOutput([0.25, -1.5, 1e-9]), [4, 5, 6], 0)
    parsed = parse_pooling_request(request({"input": "x"}))
    tensors = PoolingResponseBuilder(parsed).build(out)
    assert list(tensors) == ["text_output"]
    assert json.loads(tensors["text_output"][0]) == [0.25, -1.5, 1e-9]
    parsed = parse_pooling_request(request({"input": "x"}, return_num_input_tokens=True,
                                           return_num_output_tokens=True,
                                           return_finish_reason=True,
                                           return_num_cached_tokens=True,
                                           return_max_model_len=True, return_logprobs=True))
    tensors = PoolingResponseBuilder(parsed, max_model_len=64).build(out)
    assert tensors["num_input_tokens"].tolist() == [3] and tensors["num_output_tokens"].tolist() == [0]
    assert tensors["finish_reason"].tolist() == [b"stop"]
    assert tensors["num_cached_tokens"].tolist() == [0] and tensors["max_model_len"].tolist() == [64]
    assert "logprobs" not in tensors  # generation's switches change nothing here


def test_a_pooled_output_counts_prompt_tokens_and_no_generation():
    inflight = Inflight("r", "x", PoolingParams(), None, lambda out: {}, time.monotonic() - 1.0)
    assert inflight.num_seqs == 1
    step = StepMetrics()
    record_timings(inflight, PoolingRequestOutput("r", PoolingOutput([1.0]), [1, 2, 3, 4], 1),
                   step, time.monotonic())
    (finished,) = step.finished
    assert (finished.num_prompt_tokens, finished.num_generation_tokens) == (4, 0)
    assert finished.finish_reason == "stop" and finished.e2e >= 1.0
    assert (step.prompt_computed, step.prompt_cached, step.n_params) == (3, 1, [1])
    assert not step.ttft and not step.itl


class RecordingMetrics:
    """The metrics sink the loop hands each step to (what TritonMetrics.record receives)."""

    def __init__(self) -> None:
        self.steps: list[StepMetrics] = []

    def record(self, step: StepMetrics) -> None:
        self.steps.append(step)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return make_encoder_dir(tmp_path_factory.mktemp("bert"), "BertModel", seed=1)


ENGINE_ARGS = {"runner": "pooling", "dtype": "float32", "max_model_len": 64,
               "max_num_batched_tokens": 256}


@pytest.fixture
def pooling_loop(bert_dir):
    from backend.engine_loop import EngineLoop
    from backend.response_worker import ResponseWorker
    from engine.api import LLMEngine

    metrics = RecordingMetrics()
    worker = ResponseWorker(metrics)
    loop = EngineLoop(lambda: LLMEngine(model=str(bert_dir), **ENGINE_ARGS), worker,
                      collect_metrics=True)
    yield loop, metrics
    loop.stop(0.0)
    worker.stop()


def test_the_engine_loop_serves_a_pooling_engine(bert_dir, pooling_loop):
    from engine.api import LLM

    texts = ["the quick brown fox", "hello world", "paris is the capital of france"]
    wanted = [o.outputs.embedding for o in LLM(str(bert_dir), **ENGINE_ARGS).embed(texts)]
    loop, metrics = pooling_loop
    engine = loop.engine
    senders = [Sender() for _ in range(len(texts) + 1)]
    bad = PoolingParams(dimensions=8)  # the engine refuses it: no Matryoshka config
    for i, (sender, prompt) in enumerate(zip(senders, [*texts, texts[0]])):
        parsed = parse_pooling_request(request({"input": prompt}, return_num_input_tokens=True))
        params = bad if i == len(texts) else parsed.params
        loop.submit(Inflight(f"r{i}", parsed.prompt, params, sender,
                             PoolingResponseBuilder(parsed).build, time.monotonic()))
    wait_all(senders, timeout=60)
    for sender, want in zip(senders, wanted):
        (response,) = sender.responses
        assert response.error is None
        outputs = {t.name: t.array for t in response.output_tensors}
        np.testing.assert_allclose(json.loads(outputs["text_output"][0]), want, atol=1e-6)
        assert outputs["num_input_tokens"][0] == len(engine.tokenizer.encode(texts[senders.index(sender)]))
    error = senders[-1].error
    assert error is not None and error.code == "INVALID_ARG" and "dimensions" in error.message
    finished = [f for step in metrics.steps for f in step.finished]
    assert len(finished) == len(texts) and all(f.num_generation_tokens == 0 for f in finished)
    assert sum(f.num_prompt_tokens for f in finished) == sum(
        len(engine.tokenizer.encode(t)) for t in texts)
