"""GET /tokenizer_info in vLLM's shape (0.32, vllm/entrypoints/serve/tokenize/serving.py
TokenizerInfo): the tokenizer's init arguments (tokenizer_config.json as transformers read
it) minus its file paths, special tokens as their text, plus `tokenizer_class` and the
`chat_template` the route renders with. Served only with --enable-tokenizer-info-endpoint,
as vLLM serves it, and behind --api-key (openai_frontend/auth.py)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

# Where the files lie on this host: nothing a client can use. vLLM drops the first two;
# name_or_path is a local folder here (vLLM's is usually a hub id).
_PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    config = {key: _json_value(value)
              for key, value in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
              if key not in _PATH_FIELDS}
    config["tokenizer_class"] = type(tokenizer).__name__
    # The template chat requests are rendered with (openai_frontend.chat), wherever the
    # tokenizer found it: tokenizer_config.json or chat_template.jinja.
    template = getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def _json_value(value: Any) -> Any:
    """AddedToken (special tokens) -> its text; anything else JSON cannot hold -> str."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def install(app: FastAPI, tokenizer: Any) -> None:
    info = tokenizer_info(tokenizer)  # the tokenizer does not change while the route runs

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return info
