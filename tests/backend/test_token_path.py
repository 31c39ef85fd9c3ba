"""backend.token_request_parsing / token_responses / llm_responses without a server."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend.llm_responses import LLMResponseBuilder
from backend.request_parsing import InvalidRequest, LLMRequest, ReturnFlags
from backend.token_request_parsing import parse_token_request, words_from_trtllm_list
from backend.token_responses import TokenResponseBuilder, decode_after, decode_ids
from engine.output.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.models.gguf_cache import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


def decode_with(tokenizer):
    return lambda ids: decode_ids(tokenizer, ids)


def token_inputs(**extra):
    out = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32),
           "request_output_len": np.array([[8]], dtype=np.int32)}
    out.update({k: np.array([[v]]) for k, v in extra.items()})
    return out


def test_trtllm_defaults_are_greedy_and_sampling_needs_top_k_or_top_p():
    r = parse_token_request(token_inputs(temperature=np.float32(0.8)))
    assert r.params.temperature == 0.0 and r.prompt_token_ids == [5, 6, 7] and r.params.max_tokens == 8
    r = parse_token_request(token_inputs(runtime_top_k=np.int32(40), temperature=np.float32(0.8)))
    assert r.params.temperature == pytest.approx(0.8) and r.params.top_k == 40


def test_token_request_errors():
    with pytest.raises(InvalidRequest, match="beam_width"):
        parse_token_request(token_inputs(beam_width=np.int32(4)))
    bad = token_inputs()
    bad["bad_words_list"] = np.array([[[9], [1]]], dtype=np.int32)
    with pytest.raises(InvalidRequest, match="bad_words"):
        parse_token_request(bad)
    with pytest.raises(InvalidRequest, match="batch size"):
        parse_token_request({**token_inputs(), "input_ids": np.zeros((2, 3), np.int32)})


def test_trtllm_word_lists():
    words = np.array([[[1, 2, 3, 4], [2, 4, -1, -1]]], dtype=np.int32)
    assert words_from_trtllm_list("stop", words) == [[1, 2], [3, 4]]
    assert words_from_trtllm_list("stop", np.array([[[0], [-1]]], dtype=np.int32)) == []


def output(prompt_ids, token_ids, delta, finished, reason=None, stop_reason=None,
           on_stop_token=False):
    return RequestOutput("r", None, prompt_ids, [CompletionOutput(
        0, "", list(token_ids), finish_reason=reason, stop_reason=stop_reason,
        finished_on_stop_token=on_stop_token, delta_token_ids=list(delta))], finished)


def test_streamed_multibyte_text_survives_stateless_decoding(tokenizer):
    # The engine's detokenizer releases the deltas; postprocessing decodes each response
    # on its own after its prefix_ids.
    decode = decode_with(tokenizer)
    prompt = tokenizer.encode("Say it in Japanese:")
    text = " 日本の首都は東京です。🙂 naïve café"
    ids = tokenizer.encode(text)
    assert any(decode([t]).endswith("\ufffd") for t in ids)  # really has split characters
    request = parse_token_request({"input_ids": np.array([prompt], dtype=np.int32),
                                   "request_output_len": np.array([[len(ids)]], dtype=np.int32),
                                   "streaming": np.array([[True]])})
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, request.params)
    builder = TokenResponseBuilder(request)
    pieces, num_responses = [], 0
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        detokenizer.update([token])
        _, start, end = detokenizer.take_delta(i + 1, last)
        sent = builder.build(output(prompt, ids[:i + 1], ids[start:end], last,
                                    "length" if last else None))
        if sent is not None:
            num_responses += 1
            new = sent["output_ids"].reshape(-1).tolist()
            prefix = sent["prefix_ids"].reshape(-1).tolist()
            pieces.append(decode_after(decode, prefix, new))
    assert num_responses < len(ids)  # some tokens were held until their character completed
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == decode(prompt + ids)[len(decode(prompt)):]


def test_end_token_is_dropped_but_stop_word_tokens_kept():
    request = parse_token_request(token_inputs())
    out = TokenResponseBuilder(request).build(
        output([5, 6, 7], [9, 2], [9, 2], True, "stop", on_stop_token=True))
    assert out["output_ids"].reshape(-1).tolist() == [5, 6, 7, 9]  # input included by default
    out = TokenResponseBuilder(request).build(
        output([5, 6, 7], [9, 4], [9, 4], True, "stop", stop_reason=[9, 4]))
    assert out["output_ids"].reshape(-1).tolist()[-2:] == [9, 4]


def test_stop_words_become_id_sequences():
    inputs = token_inputs()
    inputs["stop_words_list"] = np.array([[[1, 2, 3, 4], [2, 4, -1, -1]]], dtype=np.int32)
    request = parse_token_request(inputs)
    assert request.params.stop_token_sequences == [[1, 2], [3, 4]] and not request.params.stop


def llm_output(text, delta_text, token_ids, delta_ids, finished, reason=None, logprobs=None,
               delta_logprobs=None):
    return RequestOutput("r", "Hi", [1, 2], [CompletionOutput(
        0, text, token_ids, cumulative_logprob=-1.5, logprobs=logprobs, finish_reason=reason,
        delta_text=delta_text, delta_token_ids=delta_ids, delta_logprobs=delta_logprobs)],
        finished)


def test_llm_stream_responses_carry_the_engines_deltas():
    request = LLMRequest("Hi", SamplingParams(), True, True, ReturnFlags(num_output_tokens=True,
                                                                        finish_reason=True, logprobs=True))
    builder = LLMResponseBuilder(request)
    lp = [{10: -0.5}, {11: -0.25}, {12: -1.0}]
    # The engine held token 10 back (mid-character): no tokens, no text, no response.
    assert builder.build(llm_output("", "", [10], [], False, logprobs=lp[:1],
                                    delta_logprobs=[])) is None
    first = builder.build(llm_output("ab", "ab", [10, 11], [10, 11], False, logprobs=lp[:2],
                                     delta_logprobs=lp[:2]))
    assert int(first["num_output_tokens"][0]) == 2 and first["finish_reason"][0] == b"None"
    assert len(json.loads(first["logprobs"][0])) == 2
    last = builder.build(llm_output("ab", "", [10, 11, 12], [12], True, "stop", logprobs=lp,
                                    delta_logprobs=lp[2:]))
    assert last["text_output"][0] == b"" and int(last["num_output_tokens"][0]) == 1
    assert last["finish_reason"][0] == b"stop" and json.loads(last["logprobs"][0]) == [{"12": {"logprob": -1.0}}]


def test_llm_non_streaming_prepends_prompt_unless_excluded():
    out = llm_output("ab", "b", [10, 11], [11], True, "length")
    prepend = LLMRequest("Hi", SamplingParams(), False, False, ReturnFlags())
    assert LLMResponseBuilder(prepend).build(llm_output("a", "a", [10], [10], False)) is None
    assert LLMResponseBuilder(prepend).build(out)["text_output"][0] == b"Hiab"
    exclude = LLMRequest("Hi", SamplingParams(), False, True, ReturnFlags())
    assert LLMResponseBuilder(exclude).build(out)["text_output"][0] == b"ab"


def test_token_request_priority_input():
    assert parse_token_request(token_inputs()).priority == 0
    assert parse_token_request(token_inputs(priority=np.int32(-2))).priority == -2


def test_llm_stream_interval_sends_first_text_then_every_n_tokens_then_final():
    request = LLMRequest("Hi", SamplingParams(), True, True, ReturnFlags(num_output_tokens=True,
                                                                        logprobs=True))
    builder = LLMResponseBuilder(request, stream_interval=3)
    sent = []
    steps = [("a", [1]), ("b", [2]), ("", []), ("c", [3]), ("d", [4]), ("e", [5]), ("f", [6])]
    text = ""
    for i, (delta, ids) in enumerate(steps):
        text += delta
        out = builder.build(llm_output(text, delta, [], ids, False,
                                       delta_logprobs=[{t: -0.1} for t in ids]))
        if out is not None:
            sent.append((i, out["text_output"][0].decode(), int(out["num_output_tokens"][0]),
                         len(json.loads(out["logprobs"][0]))))
    last = builder.build(llm_output(text + "g", "g", [], [7], True, "length",
                                    delta_logprobs=[{7: -0.1}]))
    # the first token at once; then when 3 are held ("bcd" at step 4); "ef" + "g" at the end
    assert sent == [(0, "a", 1, 1), (4, "bcd", 3, 3)]
    assert last["text_output"][0] == b"efg" and int(last["num_output_tokens"][0]) == 3
    assert len(json.loads(last["logprobs"][0])) == 3


def test_stream_interval_comes_from_config_pbtxt_or_model_json():
    from backend.config_params import split_parameters
    from backend.model_json import parse_model_json
    assert split_parameters({})[1].stream_interval == 1
    assert split_parameters({"stream_interval": "4"})[1].stream_interval == 4
    assert split_parameters({}, parse_model_json({"stream_interval": 8}))[1].stream_interval == 8
    assert split_parameters({"stream_interval": "2"},
                            parse_model_json({"stream_interval": 8}))[1].stream_interval == 2
    for bad in ({"stream_interval": "0"}, {"stream_interval": "x"}):
        with pytest.raises(ValueError, match="stream_interval"):
            split_parameters(bad)
    with pytest.raises(ValueError, match="stream_interval"):
        parse_model_json({"stream_interval": 0})
