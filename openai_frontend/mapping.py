"""OpenAI request -> what the `llm` model is sent: prompts (texts or token ids) and vLLM
sampling parameters.

Pure (no Triton, no HTTP), so every rule is unit-tested. Values are forwarded, not
checked: the backend validates each one and names the field (INVALID_ARG -> 400), so the
ranges live in one place (engine/core/request.py). Only what has no `llm` equivalent is
refused here. Only the sampling fields a client set are sent: the `llm` model gives the
others the model's generation_config defaults (engine/config/generation.py), as vLLM's
server does, and vLLM's own defaults without them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openai_frontend.errors import bad_request
from openai_frontend.prompts import Prompt, split_prompts
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest, CommonFields

# Forwarded under the same name when set (OpenAI's and vLLM's names agree).
_PASSTHROUGH = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty",
                "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
                "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
                "skip_special_tokens", "priority")
# OpenAI's (and vLLM's CompletionRequest) max_tokens when a completion names none.
COMPLETION_MAX_TOKENS = 16
# vLLM's older per-kind fields -> the key of vLLM's StructuredOutputsParams.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


@dataclass(frozen=True, slots=True)
class TritonRequest:
    # One `llm` request each: a text goes as text_input, token ids as prompt_token_ids.
    prompts: list[Prompt]
    sampling: dict[str, Any]
    stream: bool
    # return_logprobs: the request asked for logprobs (then sampling holds "logprobs").
    logprobs: bool
    include_usage: bool


def completion_request(req: CompletionRequest) -> TritonRequest:
    prompts = split_prompts(req.prompt)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of not in (None, 1, req.n or 1):
        raise bad_request("best_of must equal n (no ranking of sequences here)", "best_of")
    sampling = _sampling(req)
    # vLLM's rule: echo with logprobs asks the prompt's logprobs at the same k, unless
    # prompt_logprobs names its own.
    if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
        sampling["prompt_logprobs"] = req.logprobs
    # OpenAI's and vLLM's completions default, sent: the model's generation_config
    # max_new_tokens (which the `llm` model puts under absent keys) is not a completion's
    # default in vLLM. An explicit null is vLLM's "unset": that default, else up to the
    # context's end, as for chat.
    if "max_tokens" in req.model_fields_set:
        sampling["max_tokens"] = req.max_tokens
    else:
        sampling["max_tokens"] = COMPLETION_MAX_TOKENS
    if req.echo and req.max_tokens == 0:
        # vLLM's echo without generation: the engine samples one token (it cannot prefill
        # alone), the answer shows only the prompt (responses.CompletionFormat.echo_only).
        sampling["max_tokens"] = 1
    if req.logprobs is not None:
        sampling["logprobs"] = req.logprobs
    return _triton_request(req, prompts, sampling, req.logprobs is not None)


def chat_request(req: ChatCompletionRequest, prompt: str,
                 tool_constraint: dict[str, Any] | None = None,
                 keep_special_tokens: bool = False) -> TritonRequest:
    """`prompt`: the messages through the model's chat template (openai_frontend.chat);
    `tool_constraint`: what tool_choice named / "required" forces the output to
    (openai_frontend.tool_calls.plan_tools); `keep_special_tokens`: the tool-call parser
    reads markers that are special tokens."""
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad_request("send max_completion_tokens or max_tokens, not both", "max_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    sampling = _sampling(req)
    if tool_constraint is not None:
        if "structured_outputs" in sampling and req.tool_choice != "required":
            # vLLM's rule: a named tool is a constraint of its own; "required" replaces
            # the request's.
            raise bad_request("You can only either use constraints for structured outputs "
                              "or tools, not both.", "tool_choice")
        sampling["structured_outputs"] = tool_constraint
    if keep_special_tokens:
        sampling["skip_special_tokens"] = False
    # OpenAI's chat default is "until the model stops or the context is full", which
    # is the engine's max_tokens=None (bounded by max_model_len); the `llm` model gives a
    # null the model's generation_config max_new_tokens instead when it has one (vLLM's).
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling["max_tokens"] = limit
    if req.logprobs:
        sampling["logprobs"] = req.top_logprobs or 0
    # vLLM's chat default: the template already wrote the special tokens (the BOS).
    sampling["add_special_tokens"] = False
    return _triton_request(req, [prompt], sampling, req.logprobs)


def _triton_request(req: CommonFields, prompts: list[Prompt], sampling: dict[str, Any],
                    logprobs: bool) -> TritonRequest:
    options = req.stream_options
    if options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    return TritonRequest(prompts, sampling, req.stream, logprobs,
                         bool(options and options.include_usage))


def _sampling(req: CommonFields) -> dict[str, Any]:
    sampling = {name: getattr(req, name) for name in _PASSTHROUGH if getattr(req, name) is not None}
    if req.prompt_logprobs is not None:
        if req.stream and req.prompt_logprobs != 0:
            # vLLM's rule: a stream has no place for them (only echo's ride its first chunk).
            raise bad_request("prompt_logprobs are not available when stream=true",
                              "prompt_logprobs")
        sampling["prompt_logprobs"] = req.prompt_logprobs
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if req.user:  # "" from a client that fills every field: no tenant
        sampling["tenant"] = req.user
    structured = _structured_outputs(req)
    if structured is not None:
        sampling["structured_outputs"] = structured
    return sampling


def _structured_outputs(req: CommonFields) -> dict[str, Any] | None:
    given = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt.json_schema is None:
            raise bad_request("response_format json_schema needs its json_schema object",
                              "response_format")
        else:
            given.append(("response_format", {"json": fmt.json_schema.json_schema}))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs))
    for name, key in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            given.append((name, {key: value}))
    if len(given) > 1:
        raise bad_request(f"send one of {', '.join(n for n, _ in given)}, not several",
                          given[1][0])
    return given[0][1] if given else None
