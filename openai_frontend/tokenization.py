"""/tokenize and /detokenize with vLLM's request and response shapes (0.32,
vllm/entrypoints/serve/tokenize/protocol.py): a completion prompt or chat messages in,
token ids (and optionally their strings) out; token ids in, text out.

The served model's tokenizer does the work, as the `llm` model would: a chat is the
messages through the chat template, tokenized without adding special tokens again
(the template writes them), unless the request asks for them."""
from __future__ import annotations

from typing import Any, Union

from pydantic import Field

from openai_frontend.chat import render_chat
from openai_frontend.errors import bad_request
from openai_frontend.protocol import _Body


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(...)


def tokenize(tokenizer: Any, request: TokenizeRequest, max_model_len: int) -> dict[str, Any]:
    if isinstance(request, TokenizeChatRequest):
        text = render_chat(tokenizer, request.messages, request.add_generation_prompt,
                           request.continue_final_message, request.chat_template_kwargs,
                           request.tools)
    else:
        text = request.prompt
    ids = list(tokenizer(text, add_special_tokens=request.add_special_tokens)["input_ids"])
    strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(tokenizer: Any, request: DetokenizeRequest) -> dict[str, Any]:
    vocab = len(tokenizer)
    bad = [t for t in request.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens: {bad[:5]} outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": tokenizer.decode(request.tokens)}
