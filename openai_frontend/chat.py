"""The served model's tokenizer, for one job: turning chat messages into a prompt text
with the model's chat template (the `llm` model takes text and tokenizes it itself)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from openai_frontend.errors import bad_request

_ROLES = ("system", "developer", "user", "assistant", "tool")


def default_tokenizer_path() -> Path:
    """The embedded SmolLM2's tokenizer folder, found as the engine finds it (the GGUF's
    converted folder in the user's cache; converted on first use, nothing downloaded)."""
    from engine.api import tokenizer_dir

    return tokenizer_dir(None)


def load_tokenizer(path: str | os.PathLike | None) -> Any:
    from transformers import AutoTokenizer

    folder = Path(path) if path else default_tokenizer_path()
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer: {folder} is not a folder")
    # local_files_only: a path that is not a tokenizer folder fails here instead of being
    # read as a hub repository name.
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """`tools`: the request's, for templates that describe them to the model
    (transformers hands them to the template as `tools`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("the served model's tokenizer has no chat template; "
                          "use /v1/completions", "messages")
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if continue_final_message and add_generation_prompt:
        # As vLLM: continuing the last message and opening a new one contradict.
        raise bad_request("continue_final_message needs add_generation_prompt=false",
                          "continue_final_message")
    conversation = [_message(i, m) for i, m in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
            **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - templates raise what they like (jinja's raise_exception)
        raise bad_request(f"chat template failed on these messages: {exc}", "messages") from None


def _message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    role = message.get("role")
    if role not in _ROLES:
        raise bad_request(f"messages[{index}].role must be one of {list(_ROLES)}, got {role!r}",
                          "messages")
    out = dict(message)
    out["content"] = _text(index, message.get("content"))
    if isinstance(message.get("tool_calls"), list):
        out["tool_calls"] = [_template_tool_call(call) for call in message["tool_calls"]]
    return out


def _template_tool_call(call: Any) -> Any:
    """OpenAI sends a past call's arguments as a JSON text; templates (hermes, llama 3.1,
    ...) iterate over them as a mapping, so vLLM decodes them first, and so do we."""
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


def _text(index: int, content: Any) -> str:
    """A content string, or OpenAI's list of parts of which only text parts are served."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages[{index}].content: only text parts are supported, "
                                  f"got {kind!r}", "messages")
            texts.append(part["text"])
        # Joined as vLLM joins them for string-content templates.
        return "\n".join(texts)
    raise bad_request(f"messages[{index}].content must be a string or a list of parts",
                      "messages")
