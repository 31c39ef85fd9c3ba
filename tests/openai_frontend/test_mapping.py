"""openai_frontend without a server: OpenAI request -> `llm` request, Triton errors ->
OpenAI errors, `llm` outputs -> OpenAI objects, and the chat template."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from pydantic import ValidationError
from tritonclient.utils import InferenceServerException

from openai_frontend.chat import load_tokenizer, render_chat
from openai_frontend.errors import APIError, from_triton
from openai_frontend.mapping import chat_request, completion_request
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest
from openai_frontend.responses import (ChatFormat, CompletionFormat, chat_logprobs, completion_logprobs,
                                       total_cached, usage)
from openai_frontend.streaming import events
from openai_frontend.triton_client import Chunk, parse_response, request_inputs
from tests.openai_frontend.refusals import refused

USER = [{"role": "user", "content": "Hi"}]


def completion(**fields):
    return completion_request(CompletionRequest(model="m", prompt="Hello", **fields))


def chat(**fields):
    return chat_request(ChatCompletionRequest(model="m", messages=USER, **fields), "PROMPT")


def test_completion_parameters_are_forwarded_under_vllm_names():
    req = completion(max_tokens=7, temperature=0.5, top_p=0.9, n=2, stop=["\n"], seed=3,
                     logprobs=2, presence_penalty=0.1, top_k=5, min_tokens=1)
    assert req.prompts == ["Hello"] and not req.stream and req.logprobs
    assert req.sampling == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["\n"],
                            "seed": 3, "logprobs": 2, "presence_penalty": 0.1, "top_k": 5,
                            "min_tokens": 1}
    # Unset sampling fields stay unset (the `llm` model fills them from the model's
    # generation_config); max_tokens takes OpenAI's completions default (16) as vLLM's
    # CompletionRequest does, so the model's max_new_tokens never replaces it, and an
    # explicit null is vLLM's "unset": the model's default, else the context's end.
    assert completion().sampling == {"max_tokens": 16} and not completion().logprobs
    assert completion(max_tokens=None).sampling == {"max_tokens": None}


def test_completion_prompt_forms():
    """vLLM's four forms: a text, texts, token ids, lists of token ids (one `llm` request
    each); anything else is a 400 naming `prompt` before Triton, saying what is wrong."""
    def prompts(prompt):
        return completion_request(CompletionRequest(model="m", prompt=prompt)).prompts

    assert prompts("a") == ["a"] and prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]] and prompts([0]) == [[0]]
    assert prompts([[1, 2], [3]]) == [[1, 2], [3]]
    for prompt, fragment in [([], "must not be empty"), ("", "must not be empty"),
                             (["a", ""], "prompt[1] must not be empty"),
                             ([[1], []], "prompt[1] must not be empty"),
                             ([[]], "must not be empty"),
                             ([1, "a"], "not a mix"), (["a", 1], "not a mix"),
                             ([[1], "a"], "not a mix"), ([[1], 2], "not a mix"),
                             ([[1, 2], [3, "4"]], "prompt[1] must be a list of token ids"),
                             ([[1, 2], [3, 4.0]], "prompt[1] must be a list of token ids"),
                             ([1, True], "not a mix"), ([1.0], "not a mix"),
                             ([-1], "non-negative, got -1"), ([[4], [3, -7]], "prompt[1]"),
                             ([1, 2**63], "past any vocabulary"),
                             (3, "got int")]:
        error = refused(lambda: prompts(prompt), "prompt")
        assert fragment in error.message, (prompt, error.message)
    refused(lambda: completion(suffix="x"), "suffix")
    refused(lambda: completion(best_of=3), "best_of")
    # echo with logprobs asks the prompt's logprobs (tests/openai_frontend/test_echo_logprobs.py)
    assert completion(echo=True, logprobs=1).sampling["prompt_logprobs"] == 1
    assert completion(best_of=1).sampling == {"max_tokens": 16}


def test_chat_limits_and_logprobs():
    assert chat().sampling == {"max_tokens": None, "add_special_tokens": False}  # until the model stops
    assert chat(max_completion_tokens=5).sampling["max_tokens"] == 5
    assert chat(max_tokens=6).sampling["max_tokens"] == 6
    refused(lambda: chat(max_tokens=6, max_completion_tokens=5), "max_tokens")
    assert chat(logprobs=True).sampling["logprobs"] == 0
    assert chat(logprobs=True, top_logprobs=4).sampling["logprobs"] == 4
    assert "logprobs" not in chat().sampling and not chat().logprobs
    refused(lambda: chat(top_logprobs=2), "top_logprobs")
    assert chat(tool_choice="none").sampling == {"max_tokens": None, "add_special_tokens": False}


def test_response_format_becomes_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert chat(response_format={"type": "json_object"}).sampling["structured_outputs"] == {"json_object": True}
    assert chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
                ).sampling["structured_outputs"] == {"json": schema}
    assert "structured_outputs" not in chat(response_format={"type": "text"}).sampling
    assert completion(guided_choice=["a", "b"]).sampling["structured_outputs"] == {"choice": ["a", "b"]}
    assert completion(structured_outputs={"regex": "x+"}).sampling["structured_outputs"] == {"regex": "x+"}
    refused(lambda: chat(response_format={"type": "json_schema"}), "response_format")
    refused(lambda: chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex")
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=USER, response_format={"type": "xml"})


def test_stream_options():
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True).include_usage
    refused(lambda: completion(stream_options={"include_usage": True}), "stream_options")


def test_unknown_fields_are_ignored_with_a_warning_and_bad_values_refused(caplog):
    # As vLLM's OpenAIBaseModel: SDKs and agents add fields of their own.
    with caplog.at_level("WARNING", logger="openai_frontend"):
        req = CompletionRequest(model="m", prompt="x", max_token=3, stream_options=None,
                                response_format={"type": "text", "x_vendor": 1})
    assert completion_request(req).sampling == {"max_tokens": 16} and not hasattr(req, "max_token")
    assert "max_token" in caplog.text and "x_vendor" in caplog.text
    chat_req = ChatCompletionRequest(model="m", messages=USER, reasoning_effort="low")
    assert "reasoning_effort" not in chat_request(chat_req, "P").sampling
    # A known field with a bad value is still refused, naming it.
    with pytest.raises(ValidationError, match="temperature"):
        CompletionRequest(model="m", prompt="x", temperature="hot")
    refused(lambda: completion(logit_bias={"1": 5.0}), "logit_bias")
    # Fields with no effect on a self-hosted model are accepted, and not forwarded.
    assert completion(user="u", store=False, metadata={"k": "v"}).sampling == {"tenant": "u", "max_tokens": 16}


@pytest.mark.parametrize("message,status,param", [
    ("SamplingParams.temperature must be a finite number >= 0, got -1.0", 400, "temperature"),
    ("unknown sampling parameter 'max_token'", 400, "max_token"),
    ("SamplingParams.max_tokens must be an integer >= 1, got 0", 400, "max_tokens"),
    ('structured_outputs.json is invalid: Unsupported type "bogus"', 400, "response_format"),
    ("streaming requires exclude_input_in_output=true", 400, None),
    ("server busy: 1024 requests queued (MAX_QUEUE_LEN)", 503, None),
    ("engine stopped (INJECT_LOOP_FAILURE_AT_STEP)", 503, None),
    ("model was unloaded before the request finished", 503, None),
    ("Request for unknown model: 'llm' is not found", 503, None),
    ("engine step failed: RuntimeError('boom')", 500, None),
])
def test_stream_errors_are_classified_by_the_backends_messages(message, status, param):
    # Errors on a gRPC stream come without a status code, as tritonclient builds them.
    error = from_triton(InferenceServerException(msg=message))
    assert (error.status, error.param) == (status, param)
    body = error.body()["error"]
    assert body["message"] == message and set(body) == {"message", "type", "param", "code"}
    assert body["type"] == ("invalid_request_error" if status == 400 else
                            "service_unavailable_error" if status == 503 else "server_error")


def test_call_errors_use_their_grpc_status():
    unreachable = InferenceServerException(msg="failed to connect to all addresses",
                                           status="StatusCode.UNAVAILABLE")
    assert from_triton(unreachable).status == 503
    assert from_triton(InferenceServerException(msg="x", status="StatusCode.INVALID_ARGUMENT")).status == 400
    assert from_triton(InferenceServerException(msg="x", status="StatusCode.INTERNAL")).status == 500


def llm_outputs(texts, reasons, n_out, logprobs=None):
    outputs = {"text_output": np.array([t.encode() for t in texts], dtype=np.object_),
               "finish_reason": np.array([r.encode() for r in reasons], dtype=np.object_),
               "num_input_tokens": np.array([4], dtype=np.uint32),
               "num_output_tokens": np.array(n_out, dtype=np.uint32)}
    if logprobs is not None:
        outputs["logprobs"] = np.array([json.dumps(lp).encode() for lp in logprobs], dtype=np.object_)
    return outputs


def test_parse_response_reads_the_llm_tensors():
    lp = [{"7": {"logprob": -0.5, "decoded_token": " a"}, "9": {"logprob": -0.1, "decoded_token": " b"}}]
    chunk = parse_response(llm_outputs([" a", ""], ["None", "length"], [1, 0], [lp, []]), final=False)
    assert chunk.texts == [" a", ""] and chunk.finish_reasons == [None, "length"]
    assert chunk.num_input_tokens == 4 and chunk.num_output_tokens == [1, 0]
    assert chunk.logprobs == [[[(" a", -0.5), (" b", -0.1)]], []]
    assert chunk.num_cached_tokens is None  # not asked
    cached = {**llm_outputs(["x"], ["stop"], [1]), "num_cached_tokens": np.array([16], np.uint32)}
    assert parse_response(cached, final=True).num_cached_tokens == 16


def test_a_prompt_goes_as_text_input_or_as_int64_prompt_token_ids():
    def sent(prompt, **flags):
        return {i.name(): (i.datatype(), i.shape()) for i in request_inputs(prompt, {}, False, False, **flags)}

    text = sent("Hi")
    assert text["text_input"] == ("BYTES", [1]) and "prompt_token_ids" not in text
    ids = sent([5, 6, 7], cached_tokens=True)
    assert ids["prompt_token_ids"] == ("INT64", [3]) and "text_input" not in ids
    # Asked only when usage reports it, so --no-enable-prompt-tokens-details sends
    # nothing the `llm` model must know.
    assert ids["return_num_cached_tokens"] == ("BOOL", [1]) and "return_num_cached_tokens" not in text


def test_usage_reports_cached_tokens_when_asked():
    assert usage(5, 2) == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert usage(5, 2, 0)["prompt_tokens_details"] == {"cached_tokens": 0}
    # A batch: the prompts' sum; not asked (None anywhere): not reported.
    assert total_cached([16, 0, 32]) == 48 and total_cached([16, None]) is None
    assert total_cached([]) is None


def test_logprob_shapes():
    positions = [[("He", -0.5), ("She", -0.2)], [("llo", -0.1)], [("!", -1.0), ("?", -2.0), ("!", -0.9)]]
    legacy = completion_logprobs(positions, text_offset=10)
    assert legacy["tokens"] == ["He", "llo", "!"] and legacy["token_logprobs"] == [-0.5, -0.1, -1.0]
    assert legacy["text_offset"] == [10, 12, 15]
    assert legacy["top_logprobs"][0] == {"He": -0.5, "She": -0.2}
    assert legacy["top_logprobs"][2] == {"!": -0.9, "?": -2.0}  # same text: the higher one
    content = chat_logprobs(positions, top_logprobs=1)["content"]
    assert content[0]["token"] == "He" and content[0]["bytes"] == [72, 101]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["She"]  # ranked, not sampled-first


async def _collect_events(chunks, request, fmt):
    async def rest():
        for item in chunks[1:]:
            yield item
    return [e async for e in events(chunks[0], rest(), request, fmt)]


def decode(events_):
    assert events_[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events_[:-1]]


def test_chat_stream_events():
    req = chat(n=2, stream=True, stream_options={"include_usage": True})
    chunks = [(0, Chunk(["Hel", ""], [None, None], 4, [1, 0], None, False, 2)),
              (0, Chunk(["lo", "Yo"], ["stop", None], 4, [1, 1], None, False, 2)),
              (0, Chunk(["", "!"], ["stop", "length"], 4, [0, 1], None, True, 2))]
    bodies = decode(asyncio.run(_collect_events(chunks, req, ChatFormat("m"))))
    deltas = [(c["index"], c["delta"], c["finish_reason"]) for b in bodies for c in b["choices"]]
    assert deltas == [(0, {"role": "assistant", "content": "Hel"}, None),
                      (1, {"role": "assistant", "content": ""}, None),
                      (0, {"content": "lo"}, "stop"), (1, {"content": "Yo"}, None),
                      (1, {"content": "!"}, "length")]
    assert all(b["object"] == "chat.completion.chunk" and b["usage"] is None for b in bodies[:-1])
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2}}


def test_completion_stream_batch_indices_echo_and_midstream_error():
    req = completion_request(CompletionRequest(model="m", prompt=["A", "B"], stream=True))

    async def run():
        async def rest():
            yield 1, Chunk(["y"], ["length"], 2, [1], None, True)
            raise APIError(503, "server busy")
        fmt = CompletionFormat("m", echo=["A", "B"])
        return [e async for e in events((0, Chunk(["x"], ["length"], 1, [1], None, True)), rest(), req, fmt)]

    bodies = decode(asyncio.run(run()))
    assert [(c["index"], c["text"]) for b in bodies[:2] for c in b["choices"]] == [(0, "Ax"), (1, "By")]
    assert all("usage" not in b for b in bodies[:2])
    assert bodies[2] == {"error": {"message": "server busy", "type": "service_unavailable_error",
                                   "param": None, "code": None}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)  # the embedded SmolLM2's, as the CLI's default


def test_chat_template_of_the_default_model(tokenizer):
    prompt = render_chat(tokenizer, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                  {"type": "text", "text": "there"}]}])
    assert prompt.endswith("<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert render_chat(tokenizer, USER, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_chat_messages_refused(tokenizer):
    refused(lambda: render_chat(tokenizer, []), "messages")
    refused(lambda: render_chat(tokenizer, [{"role": "wizard", "content": "x"}]), "messages")
    refused(lambda: render_chat(tokenizer, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), "messages")
    refused(lambda: render_chat(tokenizer, USER, continue_final_message=True), "continue_final_message")

    class NoTemplate:
        chat_template = None
    refused(lambda: render_chat(NoTemplate(), USER), "messages")


def test_openai_user_is_the_tenant():
    assert completion(user="alice").sampling["tenant"] == "alice"
    assert chat(user="bob").sampling["tenant"] == "bob"
    assert "tenant" not in completion(user="").sampling
    assert "tenant" not in chat().sampling
