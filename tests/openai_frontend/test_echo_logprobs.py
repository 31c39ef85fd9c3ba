"""Completions echo with logprobs (issue 47), without a server: the request asks the
`llm` model for prompt logprobs, and the answer puts the prompt's before the completion's
in OpenAI's legacy shape, as vLLM 0.32 builds it (None for the first prompt token,
text_offset running over prompt + completion, max_tokens 0 showing the prompt alone)."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from openai_frontend.app import first_token
from openai_frontend.errors import APIError
from openai_frontend.mapping import chat_request, completion_request
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest
from openai_frontend.responses import ChoiceState, CompletionFormat, prompt_positions
from openai_frontend.streaming import events
from openai_frontend.triton_client import Chunk, parse_response

# What the `llm` model sends for the prompt "ab cd" tokenized [7, 8, 9] with k=1: null
# first, then the prompt token followed by the top one (here another token, then itself).
PROMPT_LOGPROBS = [None,
                   {"8": {"logprob": -2.5, "rank": 3, "decoded_token": "ab"},
                    "4": {"logprob": -0.5, "rank": 1, "decoded_token": "xy"}},
                   {"9": {"logprob": -0.25, "rank": 1, "decoded_token": " cd"}}]


def completion(**fields):
    return completion_request(CompletionRequest(model="m", prompt="Hello", **fields))


def test_echo_with_logprobs_asks_the_prompts_at_the_same_k():
    assert completion(echo=True, logprobs=2).sampling["prompt_logprobs"] == 2
    # prompt_logprobs named by the client wins (vLLM's rule), and rides alone without echo
    assert completion(echo=True, logprobs=2, prompt_logprobs=5).sampling["prompt_logprobs"] == 5
    assert completion(prompt_logprobs=3).sampling["prompt_logprobs"] == 3
    assert "prompt_logprobs" not in completion(echo=True).sampling
    assert "prompt_logprobs" not in completion(logprobs=2).sampling


def test_echo_with_max_tokens_0_samples_one_token_it_does_not_show():
    assert completion(echo=True, max_tokens=0).sampling["max_tokens"] == 1
    # without echo 0 is forwarded, for the `llm` model to refuse as vLLM does
    assert completion(max_tokens=0).sampling["max_tokens"] == 0


def test_prompt_logprobs_refused_on_a_stream_as_vllm():
    with pytest.raises(APIError) as error:
        completion(prompt_logprobs=2, stream=True)
    assert error.value.status == 400 and error.value.param == "prompt_logprobs"
    assert completion(prompt_logprobs=0, stream=True).sampling["prompt_logprobs"] == 0
    # echo's own prompt logprobs do stream: they ride the first chunk
    assert completion(echo=True, logprobs=1, stream=True).sampling["prompt_logprobs"] == 1
    messages = [{"role": "user", "content": "x"}]
    chat = chat_request(ChatCompletionRequest(model="m", messages=messages, prompt_logprobs=2),
                        "PROMPT")
    assert chat.sampling["prompt_logprobs"] == 2


def test_prompt_logprobs_output_is_parsed_and_minus_inf_clamped():
    raw = json.dumps([None, {"3": {"logprob": float("-inf"), "rank": 9, "decoded_token": "q"}}])
    outputs = {"text_output": np.array([b"x"], dtype=np.object_),
               "finish_reason": np.array([b"length"], dtype=np.object_),
               "num_input_tokens": np.array([2], dtype=np.uint32),
               "num_output_tokens": np.array([1], dtype=np.uint32),
               "prompt_logprobs": np.array([raw.encode()], dtype=np.object_)}
    chunk = parse_response(outputs, final=True)
    assert chunk.prompt_logprobs == [None, {"3": {"logprob": -9999.0, "rank": 9,
                                                   "decoded_token": "q"}}]
    del outputs["prompt_logprobs"]
    assert parse_response(outputs, final=True).prompt_logprobs is None


def test_prompt_positions_put_the_prompt_token_first_and_none_for_the_first():
    assert prompt_positions("<s>", PROMPT_LOGPROBS) == [
        [("<s>", None)], [("ab", -2.5), ("xy", -0.5)], [(" cd", -0.25)]]


def echo_format(max_tokens_0: bool = False) -> CompletionFormat:
    return CompletionFormat("m", echo=["<s>ab cd"], echo_first_tokens=["<s>"],
                            echo_only=max_tokens_0)


def test_whole_answer_has_prompt_then_completion_logprobs_with_running_offsets():
    state = ChoiceState(prompt_logprobs=PROMPT_LOGPROBS)
    choice = echo_format().choice(0, " ef", "length", [[(" ef", -1.0), (" gh", -0.75)]], state,
                                  chunk=False)
    assert choice["text"] == "<s>ab cd ef"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["<s>", "ab", " cd", " ef"]
    assert logprobs["token_logprobs"] == [None, -2.5, -0.25, -1.0]
    assert logprobs["top_logprobs"] == [None, {"ab": -2.5, "xy": -0.5}, {" cd": -0.25},
                                        {" ef": -1.0, " gh": -0.75}]
    # offsets into the returned text: each token starts where the text shows it
    assert logprobs["text_offset"] == [0, 3, 5, 8]
    assert all(choice["text"][o:].startswith(t)
               for o, t in zip(logprobs["text_offset"], logprobs["tokens"]))
    # vLLM returns the prompt's logprobs on the choice of a whole answer as well
    assert choice["prompt_logprobs"] == PROMPT_LOGPROBS


def test_max_tokens_0_shows_the_prompt_alone():
    state = ChoiceState(prompt_logprobs=PROMPT_LOGPROBS)
    choice = echo_format(max_tokens_0=True).choice(0, " ef", "length", [[(" ef", -1.0)]], state,
                                                   chunk=False)
    assert choice["text"] == "<s>ab cd"
    assert choice["logprobs"]["tokens"] == ["<s>", "ab", " cd"]
    assert choice["logprobs"]["token_logprobs"] == [None, -2.5, -0.25]
    # echo without logprobs: the prompt's text alone, no logprobs
    fmt = CompletionFormat("m", echo=["hi"], echo_only=True)
    assert fmt.choice(0, " x", "length", None, ChoiceState(), chunk=False)["text"] == "hi"


def test_missing_prompt_logprobs_is_a_server_error_not_a_wrong_answer():
    with pytest.raises(APIError) as error:
        echo_format().choice(0, " ef", "length", [[(" ef", -1.0)]], ChoiceState(), chunk=False)
    assert error.value.status == 500 and "prompt_logprobs" in error.value.message


def streamed_echo(first: Chunk, *rest: Chunk) -> list[dict]:
    """The SSE chunks of an echo + logprobs=1 completion stream whose Triton responses
    are `first` (the one holding the prompt logprobs), then `rest`."""
    async def source():
        for chunk in rest:
            yield 0, chunk

    async def collect():
        request = completion(echo=True, logprobs=1, stream=True)
        return [e async for e in events((0, first), source(), request, echo_format())]

    return [json.loads(e[6:]) for e in asyncio.run(collect()) if "[DONE]" not in e]


def test_stream_carries_the_prompts_logprobs_on_its_first_chunk():
    chunks = streamed_echo(
        Chunk([" ef"], [None], 3, [1], [[[(" ef", -1.0)]]], False,
              prompt_logprobs=PROMPT_LOGPROBS),
        Chunk([" gh"], [None], 3, [1], [[[(" gh", -0.5)]]], False),
        Chunk([" ij"], ["length"], 3, [1], [[[(" ij", -0.75)]]], True))
    choices = [c["choices"][0] for c in chunks]
    assert [c["text"] for c in choices] == ["<s>ab cd ef", " gh", " ij"]
    assert choices[0]["logprobs"]["tokens"] == ["<s>", "ab", " cd", " ef"]
    assert choices[0]["logprobs"]["token_logprobs"][0] is None
    assert "prompt_logprobs" not in choices[0]
    # offsets keep running over the whole text
    offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
    assert offsets == [0, 3, 5, 8, 11, 14]
    assert "".join(c["text"] for c in choices)[11:].startswith(" gh")


def test_a_held_back_token_still_brings_its_logprobs_and_the_echo():
    # the first token's text is held back (empty), its logprobs are not
    chunks = streamed_echo(
        Chunk([""], [None], 3, [1], [[[("\ufffd", -3.0)]]], False,
              prompt_logprobs=PROMPT_LOGPROBS),
        Chunk([" ef"], ["length"], 3, [1], [[[(" ef", -1.0)]]], True))
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == ["<s>", "ab", " cd", "\ufffd", " ef"]
    assert chunks[0]["choices"][0]["text"] == "<s>ab cd"


def test_echo_of_a_batch_with_n_maps_choices_to_their_prompts():
    from openai_frontend.app import per_choice

    fmt = CompletionFormat("m", echo=per_choice(["P0", "P1"], 2),
                           echo_first_tokens=per_choice(["a", "b"], 2))
    lp = [None, {"5": {"logprob": -1.0, "rank": 1, "decoded_token": "x"}}]
    for index, prompt, first in [(0, "P0", "a"), (1, "P0", "a"), (2, "P1", "b"), (3, "P1", "b")]:
        choice = fmt.choice(index, "!", "stop", [[("!", -0.5)]], ChoiceState(prompt_logprobs=lp),
                            chunk=False)
        assert choice["text"] == prompt + "!" and choice["index"] == index
        assert choice["logprobs"]["tokens"] == [first, "x", "!"]


def test_first_token_is_the_prompts_first_as_the_model_tokenizes_it(tmp_path):
    from transformers import AutoTokenizer

    from testing.bos_tokenizer import make_bos_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(make_bos_tokenizer_dir(tmp_path))
    assert first_token(tokenizer, "hello there") == "<s>"  # the BOS the model adds
    assert first_token(tokenizer, [4, 5]) == tokenizer.decode([4])  # ids as they are
