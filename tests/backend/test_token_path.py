"""backend.token_request_parsing / token_responses / llm_responses without a server."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend.llm_responses import LLMResponseBuilder
from backend.request_parsing import InvalidRequest, LLMRequest, ReturnFlags, parse_llm_request
from backend.token_request_parsing import parse_token_request, words_from_trtllm_list
from backend.token_responses import TokenResponseBuilder, decode_after, decode_ids
from engine.output.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from testing.output_driver import Driver


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
    # The fuzz tests found this message naming no field.
    with pytest.raises(InvalidRequest, match="input_ids: batch size"):
        parse_token_request({**token_inputs(), "input_ids": np.zeros((2, 3), np.int32)})


def test_trtllm_word_lists():
    words = np.array([[[1, 2, 3, 4], [2, 4, -1, -1]]], dtype=np.int32)
    assert words_from_trtllm_list("stop", words) == [[1, 2], [3, 4]]
    assert words_from_trtllm_list("stop", np.array([[[0], [-1]]], dtype=np.int32)) == []


def output(prompt_ids, token_ids, finished, reason=None, stop_reason=None, on_stop_token=False):
    """A DELTA output (a stream's: the ids released since the previous one) or a FINAL_ONLY
    one (all ids): either way `token_ids` is what the response carries."""
    return RequestOutput("r", None, prompt_ids, [CompletionOutput(
        0, "", list(token_ids), finish_reason=reason, stop_reason=stop_reason,
        finished_on_stop_token=on_stop_token, delta_token_ids=list(token_ids))], finished)


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
    assert request.params.output_kind is RequestOutputKind.DELTA
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, request.params)
    builder = TokenResponseBuilder(request)
    pieces, num_responses = [], 0
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        detokenizer.update([token])
        _, start, end = detokenizer.take_delta(i + 1, last)
        if start == end and not last:
            continue  # nothing released: the engine hands out no output
        sent = builder.build(output(prompt, ids[start:end], last, "length" if last else None))
        num_responses += 1
        new = sent["output_ids"].reshape(-1).tolist()
        prefix = sent["prefix_ids"].reshape(-1).tolist()
        pieces.append(decode_after(decode, prefix, new))
    assert num_responses < len(ids)  # some tokens were held until their character completed
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == decode(prompt + ids)[len(decode(prompt)):]


def test_end_token_is_dropped_but_stop_word_tokens_kept():
    request = parse_token_request(token_inputs())
    assert request.params.output_kind is RequestOutputKind.FINAL_ONLY
    out = TokenResponseBuilder(request).build(
        output([5, 6, 7], [9, 2], True, "stop", on_stop_token=True))
    assert out["output_ids"].reshape(-1).tolist() == [5, 6, 7, 9]  # input included by default
    out = TokenResponseBuilder(request).build(
        output([5, 6, 7], [9, 4], True, "stop", stop_reason=[9, 4]))
    assert out["output_ids"].reshape(-1).tolist()[-2:] == [9, 4]


def test_stop_words_become_id_sequences():
    inputs = token_inputs()
    inputs["stop_words_list"] = np.array([[[1, 2, 3, 4], [2, 4, -1, -1]]], dtype=np.int32)
    request = parse_token_request(inputs)
    assert request.params.stop_token_sequences == [[1, 2], [3, 4]] and not request.params.stop


def llm_output(text, token_ids, finished, reason=None, logprobs=None):
    """A DELTA output (what is new) or a FINAL_ONLY one (everything): the response
    translates text / token_ids / logprobs either way."""
    return RequestOutput("r", "Hi", [1, 2], [CompletionOutput(
        0, text, token_ids, cumulative_logprob=-1.5, logprobs=logprobs, finish_reason=reason,
        delta_text=text, delta_token_ids=token_ids, delta_logprobs=logprobs)], finished)


def test_llm_stream_responses_carry_the_engines_deltas():
    request = LLMRequest("Hi", SamplingParams(), True, True, ReturnFlags(num_output_tokens=True,
                                                                        finish_reason=True, logprobs=True))
    builder = LLMResponseBuilder(request)
    lp = [{10: Logprob(-0.5, 1)}, {11: Logprob(-0.25, 1)}, {12: Logprob(-1.0, 3), 13: Logprob(-0.5, 1)}]
    # Token 10 was held back (mid-character) and came out with 11's text.
    first = builder.build(llm_output("ab", [10, 11], False, logprobs=lp[:2]))
    assert first["text_output"][0] == b"ab"
    assert int(first["num_output_tokens"][0]) == 2 and first["finish_reason"][0] == b"None"
    assert len(json.loads(first["logprobs"][0])) == 2
    # The final output adds no text (EOS): still a response, the last.
    last = builder.build(llm_output("", [12], True, "stop", logprobs=lp[2:]))
    assert last["text_output"][0] == b"" and int(last["num_output_tokens"][0]) == 1
    assert last["finish_reason"][0] == b"stop" and json.loads(last["logprobs"][0]) == [
        {"12": {"logprob": -1.0, "rank": 3}, "13": {"logprob": -0.5, "rank": 1}}]


def test_llm_non_streaming_prepends_prompt_unless_excluded():
    out = llm_output("ab", [10, 11], True, "length")
    prepend = LLMRequest("Hi", SamplingParams(), False, False, ReturnFlags())
    assert LLMResponseBuilder(prepend).build(out)["text_output"][0] == b"Hiab"
    exclude = LLMRequest("Hi", SamplingParams(), False, True, ReturnFlags())
    assert LLMResponseBuilder(exclude).build(out)["text_output"][0] == b"ab"


def test_token_request_priority_input():
    assert parse_token_request(token_inputs()).priority == 0
    assert parse_token_request(token_inputs(priority=np.int32(-2))).priority == -2


def test_stream_interval_comes_from_config_pbtxt_or_model_json():
    from backend.config_params import split_parameters
    from backend.model_json import parse_model_json

    def interval(params, model_json=None):
        return split_parameters(params, model_json)[0].scheduler.stream_interval

    # An engine argument now, for whichever engine model loads it.
    assert interval({}) == 1
    assert interval({"stream_interval": "4"}) == 4
    assert interval({}, parse_model_json({"stream_interval": 8})) == 8
    assert interval({"stream_interval": "2"}, parse_model_json({"stream_interval": 8})) == 2
    for bad in ({"stream_interval": "0"}, {"stream_interval": "x"}):
        with pytest.raises(ValueError, match="stream_interval"):
            split_parameters(bad)
    with pytest.raises(ValueError, match="stream_interval"):
        parse_model_json({"stream_interval": 0})


def plain_words(tokenizer, count):
    ids = tokenizer.encode(" The quick brown fox jumps over the lazy dog again",
                           add_special_tokens=False)
    assert len(ids) >= count
    return ids[:count]


def test_llm_stream_responses_follow_the_engines_stream_interval(tokenizer):
    request = parse_llm_request(
        {"text_input": np.array([b"Hi"], dtype=np.object_), "stream": np.array([True]),
         "return_num_output_tokens": np.array([True]), "return_logprobs": np.array([True]),
         "return_finish_reason": np.array([True])}, json.dumps({"max_tokens": 10, "logprobs": 0}))
    assert request.params.output_kind is RequestOutputKind.DELTA and request.params.logprobs == 0
    driver = Driver(tokenizer, stream_interval=3)
    (sequence,) = driver.add("r", request.params, [plain_words(tokenizer, 10)])
    builder = LLMResponseBuilder(request)
    sent = [builder.build(out) for _, out in driver.run()]
    # The first token at once, then every 3 tokens, and the final response.
    assert [int(r["num_output_tokens"][0]) for r in sent] == [1, 3, 3, 3]
    assert [len(json.loads(r["logprobs"][0])) for r in sent] == [1, 3, 3, 3]
    assert [r["finish_reason"][0] for r in sent] == [b"None"] * 3 + [b"length"]
    assert b"".join(r["text_output"][0] for r in sent).decode() == sequence.detokenizer.output_text


def test_stream_interval_applies_to_the_token_model(tmp_path, tokenizer):
    # The `tensorrt_llm` model's engine gets it from config.pbtxt like the `llm` model's.
    from backend.config_params import split_parameters
    from engine import LLMEngine
    from testing.tiny_model import make_tiny_model_dir

    config, _ = split_parameters({"model": str(make_tiny_model_dir(tmp_path, seed=3)),
                                  "dtype": "float32", "num_kv_blocks": "128",
                                  "stream_interval": "3"})
    engine = LLMEngine(config)
    prompt = tokenizer.encode("Once upon a time")
    inputs = {"input_ids": np.array([prompt], dtype=np.int32),
              "request_output_len": np.array([[14]], dtype=np.int32)}
    stream = parse_token_request({**inputs, "streaming": np.array([[True]])})
    whole = parse_token_request({**inputs, "exclude_input_in_output": np.array([[True]])})
    engine.add_request("s", stream.prompt_token_ids, stream.params)
    engine.add_request("w", whole.prompt_token_ids, whole.params)
    outputs = {"s": [], "w": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert len(outputs["w"]) == 1  # FINAL_ONLY: the finished output alone
    stream_builder = TokenResponseBuilder(stream)
    chunks = [stream_builder.build(out)["output_ids"].reshape(-1).tolist() for out in outputs["s"]]
    final = TokenResponseBuilder(whole).build(outputs["w"][0])["output_ids"].reshape(-1).tolist()
    assert sum(chunks, []) == final and len(final) == 14
    assert all(len(chunk) >= 3 for chunk in chunks[1:-1]) and len(chunks) <= 1 + -(-13 // 3)
    assert len(chunks) > 2  # really a stream, not one response


def test_tenant_input_of_the_token_model():
    assert parse_token_request(token_inputs(tenant=b"acme")).tenant == "acme"
    assert parse_token_request(token_inputs(tenant=b"")).tenant is None  # ensemble's "unset"
    assert parse_token_request(token_inputs()).tenant is None
    with pytest.raises(InvalidRequest, match="tenant must be"):
        parse_token_request(token_inputs(tenant=b"x" * 200))
