"""n > 1 on the backend side without a server: the `n` rule of request parsing and the
`llm` response tensors (one entry per sequence, as vllm_backend sends)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend.llm_responses import LLMResponseBuilder
from backend.request_parsing import (InvalidRequest, LLMRequest, ReturnFlags, parse_llm_request,
                                     parse_sampling_parameters)
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

ALL_RETURNS = ReturnFlags(finish_reason=True, num_input_tokens=True, num_output_tokens=True,
                          cumulative_logprob=True, logprobs=True)


def completion(index, text, token_ids, reason=None):
    """A DELTA completion (what is new) or a FINAL_ONLY one (everything): the responses
    translate text / token_ids / logprobs either way."""
    logprobs = [{t: Logprob(-0.5, 1)} for t in token_ids]
    return CompletionOutput(index, text, list(token_ids), cumulative_logprob=-0.5 * len(token_ids),
                            logprobs=logprobs, finish_reason=reason, delta_text=text,
                            delta_token_ids=list(token_ids), delta_logprobs=logprobs)


def output(completions, finished):
    return RequestOutput("r", "Hi", [1, 2, 3], completions, finished)


def test_n_is_parsed_and_best_of_and_beam_search_stay_invalid():
    assert parse_sampling_parameters({"n": 3, "seed": 4}).n == 3
    assert parse_sampling_parameters({"n": "2", "best_of": "1"}).n == 2
    request = parse_llm_request({"text_input": np.array([b"Hi"], dtype=np.object_)},
                                json.dumps({"n": 3, "temperature": 0.5}))
    assert request.params.n == 3
    for bad, name in (({"best_of": 3}, "best_of"), ({"n": 2, "best_of": 2}, "best_of"),
                      ({"use_beam_search": True}, "use_beam_search"), ({"n": 0}, "n"),
                      ({"n": 17}, "n"), ({"n": 1.5}, "n")):
        with pytest.raises(InvalidRequest, match=name):
            parse_sampling_parameters(bad)


def test_non_streaming_response_has_one_entry_per_sequence():
    out = output([completion(0, "ab", [10, 11], reason="length"),
                  completion(1, "c", [12], reason="stop"),
                  completion(2, "def", [13, 14, 15], reason="length")], True)
    tensors = LLMResponseBuilder(LLMRequest("Hi", SamplingParams(n=3), False, False,
                                            ALL_RETURNS)).build(out)
    assert tensors["text_output"].tolist() == [b"Hiab", b"Hic", b"Hidef"]
    assert tensors["finish_reason"].tolist() == [b"length", b"stop", b"length"]
    assert tensors["num_output_tokens"].tolist() == [2, 1, 3]
    assert tensors["num_input_tokens"].tolist() == [3]
    assert tensors["cumulative_logprob"].tolist() == [-1.0, -0.5, -1.5]
    assert [len(json.loads(x)) for x in tensors["logprobs"]] == [2, 1, 3]
    excluded = LLMResponseBuilder(LLMRequest("Hi", SamplingParams(n=3), False, True, ReturnFlags()))
    assert excluded.build(out)["text_output"].tolist() == [b"ab", b"c", b"def"]


def test_streaming_response_carries_each_sequences_delta_in_its_entry():
    builder = LLMResponseBuilder(LLMRequest("Hi", SamplingParams(n=2), True, True, ALL_RETURNS))
    # Sequence 1 has nothing new this step (DELTA: an empty completion).
    step = builder.build(output([completion(0, "a", [10, 11]), completion(1, "", [])], False))
    assert step["text_output"].tolist() == [b"a", b""]
    assert step["num_output_tokens"].tolist() == [2, 0]
    assert step["finish_reason"].tolist() == [b"None", b"None"]
    assert [json.loads(x) for x in step["logprobs"]] == [[{"10": {"logprob": -0.5, "rank": 1}},
                                                          {"11": {"logprob": -0.5, "rank": 1}}], []]
    # The last response is FINAL even when no sequence has new text.
    last = builder.build(output([completion(0, "", [], reason="length"),
                                 completion(1, "", [2], reason="stop")], True))
    assert last["text_output"].tolist() == [b"", b""]
    assert last["num_output_tokens"].tolist() == [0, 1]
    assert last["finish_reason"].tolist() == [b"length", b"stop"]


def test_single_sequence_responses_keep_their_one_entry_shape():
    builder = LLMResponseBuilder(LLMRequest("Hi", SamplingParams(), False, True, ALL_RETURNS))
    tensors = builder.build(output([completion(0, "ab", [10, 11], reason="length")], True))
    assert {k: v.shape for k, v in tensors.items()} == {
        "text_output": (1,), "finish_reason": (1,), "num_input_tokens": (1,),
        "num_output_tokens": (1,), "cumulative_logprob": (1,), "logprobs": (1,)}


def test_engine_stream_through_the_builder_equals_the_final_texts(tmp_path):
    from engine import LLMEngine
    from testing.tiny_model import make_tiny_model_dir

    engine = LLMEngine(model=str(make_tiny_model_dir(tmp_path, seed=3)), dtype="float32",
                       num_kv_blocks=128, stream_interval=3)
    params = dict(n=3, seed=9, max_tokens=10, ignore_eos=True)
    # As the `llm` model adds them: a stream DELTA, a non-streaming request FINAL_ONLY.
    delta = SamplingParams(**params, output_kind=RequestOutputKind.DELTA)
    final_only = SamplingParams(**params, output_kind=RequestOutputKind.FINAL_ONLY)
    stream = LLMResponseBuilder(LLMRequest("Hello", delta, True, True, ALL_RETURNS))
    whole = LLMResponseBuilder(LLMRequest("Hello", final_only, False, True, ALL_RETURNS))
    engine.add_request("s", "Hello", delta)
    engine.add_request("w", "Hello", final_only)
    texts, counts, responses, finals = [b""] * 3, [0] * 3, 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "w":
                finals.append(whole.build(out))
                continue
            tensors = stream.build(out)
            responses += 1
            texts = [a + b for a, b in zip(texts, tensors["text_output"].tolist())]
            counts = [a + b for a, b in zip(counts, tensors["num_output_tokens"].tolist())]
    (final,) = finals
    assert texts == final["text_output"].tolist() and len(texts) == 3
    assert counts == final["num_output_tokens"].tolist() == [10, 10, 10]
    assert responses <= 1 + -(-9 // 3)  # the first at once, then every 3 tokens
