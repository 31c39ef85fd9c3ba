"""The `llm` model's token ids for a chat prompt from the OpenAI route equal vLLM 0.32's
own (vllm/renderers: HfRenderer.render_messages, then tokenize_prompt with its
default_chat_tok_params), for a tokenizer that adds a BOS its chat template also writes."""
from __future__ import annotations

import json

import numpy as np

from backend.request_parsing import parse_llm_request
from openai_frontend.chat import render_chat
from openai_frontend.mapping import chat_request
from openai_frontend.protocol import ChatCompletionRequest
from testing.bos_tokenizer import make_bos_tokenizer_dir
from testing.tiny_model import make_tiny_model_dir

VLLM_CHAT_IDS = """
import json, sys
from vllm.config import ModelConfig, VllmConfig
from vllm.renderers.params import ChatParams
from vllm.renderers.registry import renderer_from_config

payload = json.load(sys.stdin)
config = VllmConfig(model_config=ModelConfig(model=payload["model"], tokenizer=payload["tokenizer"],
                                             max_model_len=256))
renderer = renderer_from_config(config)
# What vLLM's chat completions serving passes for add_generation_prompt=true.
params = ChatParams(chat_template_kwargs={"add_generation_prompt": True})
_, prompt = renderer.render_messages(payload["messages"], params)
tokenized = renderer.tokenize_prompt(prompt, renderer.default_chat_tok_params)
print(json.dumps(tokenized["prompt_token_ids"]))
"""
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def test_chat_prompt_ids_equal_vllms(vllm_side, tmp_path):
    from transformers import AutoTokenizer

    model = make_tiny_model_dir(tmp_path / "model")
    tokenizer_dir = make_bos_tokenizer_dir(tmp_path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt = render_chat(tokenizer, MESSAGES)
    sampling = chat_request(ChatCompletionRequest(model="m", messages=MESSAGES), prompt).sampling
    parsed = parse_llm_request({
        "text_input": np.array([prompt.encode()], dtype=np.object_),
        "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_)})
    ours = tokenizer.encode(parsed.prompt, add_special_tokens=parsed.add_special_tokens)
    theirs = vllm_side.run(VLLM_CHAT_IDS, {"model": str(model), "tokenizer": str(tokenizer_dir),
                                           "messages": MESSAGES})
    assert ours == theirs
    assert theirs.count(tokenizer.bos_token_id) == 1
