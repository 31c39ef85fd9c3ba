"""A chat prompt the OpenAI route renders reaches the `llm` model with
add_special_tokens false and is tokenized as vLLM tokenizes a rendered chat prompt: for a
tokenizer that adds a BOS the template already wrote (Llama-3, Mistral), one BOS."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend.request_parsing import parse_llm_request
from openai_frontend.chat import render_chat
from openai_frontend.mapping import chat_request, completion_request
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest
from testing.bos_tokenizer import make_bos_tokenizer_dir

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_bos_tokenizer_dir(tmp_path_factory.mktemp("bos")))


def as_llm_inputs(prompt: str, sampling: dict) -> dict:
    # What openai_frontend/triton_client.py sends.
    return {"text_input": np.array([prompt.encode()], dtype=np.object_),
            "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_)}


def test_rendered_chat_prompt_gets_one_bos(tokenizer):
    prompt = render_chat(tokenizer, MESSAGES)
    assert prompt.startswith(tokenizer.bos_token)  # the template wrote it
    triton = chat_request(ChatCompletionRequest(model="m", messages=MESSAGES), prompt)
    parsed = parse_llm_request(as_llm_inputs(prompt, triton.sampling))
    assert parsed.add_special_tokens is False
    # backend/llm_model.py's call.
    ids = tokenizer.encode(parsed.prompt, add_special_tokens=parsed.add_special_tokens)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    # transformers' own chat tokenization (what vLLM's renderer reproduces) agrees.
    assert ids == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)


def test_text_prompts_still_get_the_tokenizers_special_tokens(tokenizer):
    triton = completion_request(CompletionRequest(model="m", prompt="hello there"))
    parsed = parse_llm_request(as_llm_inputs("hello there", triton.sampling))
    assert parsed.add_special_tokens is True
    assert tokenizer.encode(parsed.prompt, add_special_tokens=parsed.add_special_tokens)[0] == \
        tokenizer.bos_token_id


@pytest.mark.parametrize("value, expected", [(False, False), ("false", False), (True, True)])
def test_add_special_tokens_in_either_json(value, expected):
    inputs = as_llm_inputs("hi", {"add_special_tokens": value, "max_tokens": 2})
    assert parse_llm_request(inputs).add_special_tokens is expected
    text_only = {"text_input": inputs["text_input"]}
    params = json.dumps({"add_special_tokens": value})
    assert parse_llm_request(text_only, params).add_special_tokens is expected
