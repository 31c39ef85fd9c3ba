"""The request bodies of /v1/completions and /v1/chat/completions (OpenAI's names), and of
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (its names).

Unknown fields are ignored with a warning in the log, as vLLM ignores them (its
OpenAIBaseModel): agents and SDKs add fields of their own that no server can predict.
A known field with a bad value is still a 400 naming it. The fields a client may send that
change nothing for a self-hosted model (`user`, `store`, ...) are accepted. vLLM's extra sampling parameters, which its clients send through the
openai client's `extra_body`, are forwarded to the `llm` model under the same names."""
from __future__ import annotations

import logging
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from backend.json_text import dotted, find_lone_surrogate
from openai_frontend.errors import bad_request
from openai_frontend.prompts import split_prompts

log = logging.getLogger("openai_frontend")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="wrap")
    @classmethod
    def _warn_ignored(cls, data: Any, handler: Any) -> Any:
        result = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            ignored = sorted(set(data) - known)
            if ignored:
                log.warning("%s: ignored unknown fields %s", cls.__name__, ignored)
        return result


def lone_surrogate(data: Any) -> tuple[str, str] | None:
    """(where, which) of the first lone surrogate in a parsed JSON body, else None: where
    is the string's field (a key's: the object holding it), which its \\uXXXX escape."""
    found = find_lone_surrogate(data)
    if found is None:
        return None
    path, in_key, char = found
    return dotted(path[:-1] if in_key else path) or "body", f"\\u{ord(char):04x}"


class _Body(_Lenient):
    """A whole request body: refused with a 400 naming the field when a string holds a
    lone surrogate (never a 500 later, where the text is encoded)."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        found = lone_surrogate(data)
        if found:
            where, which = found
            raise bad_request(f"{where}: a lone surrogate ({which}) is not Unicode text; "
                              "send valid UTF-8", where.split(".")[0].split("[")[0])
        return data


class StreamOptions(_Lenient):
    include_usage: bool = False
    # vLLM's: usage on every chunk. Accepted only off, so a client relying on it hears so.
    continuous_usage_stats: Literal[False] = False


class JsonSchema(_Lenient):
    name: str = "response"
    description: str | None = None
    # OpenAI's key is `schema`, a name pydantic's BaseModel reserves.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class CommonFields(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI's end-user id: the request's tenant under policy="fair" (mapping.py).
    user: str | None = None
    # Accepted, no effect here: storage and billing options.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's extras, forwarded as they are (the backend validates them).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None
    # vLLM's: the prompt's logprobs, top k per position, returned as vLLM returns them
    # (completions: on each choice; chat: on the response).
    prompt_logprobs: int | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(CommonFields):
    # Text, a batch of texts, token ids, or a batch of id prompts (vLLM's forms). Strict:
    # pydantic would otherwise read "2", true or 2.0 as the id 2.
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, value: Any) -> Any:
        split_prompts(value)  # a 400 naming `prompt` that says what is wrong, not pydantic's
        return value


class ChatCompletionRequest(CommonFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat-template switches.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class LoadLoRAAdapterRequest(_Body):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str
    # vLLM's field; the name alone selects the adapter there too.
    lora_int_id: int | None = None
