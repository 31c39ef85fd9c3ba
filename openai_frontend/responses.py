"""`llm` outputs -> OpenAI response objects: choices, logprobs and usage, for
/v1/completions and /v1/chat/completions, whole (non-streaming) or as stream chunks.

Pure; the two formats share one shape (OutputFormat) so the streaming code and the
non-streaming code do not care which endpoint they serve."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from openai_frontend.errors import APIError
from openai_frontend.reasoning import ReasoningPlan, ReasoningStream
from openai_frontend.tool_calls import (ToolPlan, ToolStream, extract, finish_reason,
                                        message_tool_calls)

# Per new token: [(token text, logprob), ...], the sampled token first (triton_client.Chunk).
# A logprob of None: the prompt's first token, which has none (nothing comes before it).
Positions = list[list[tuple[str, float | None]]]


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far (streaming, or one final response)."""
    started: bool = False
    finish_reason: str | None = None
    # Characters of completion text so far: completions' logprobs.text_offset.
    text_offset: int = 0
    completion_tokens: int = 0
    # Chat with tools, streamed: what of the text went out as content / tool calls.
    tools: ToolStream | None = None
    # Chat with --reasoning-parser, streamed: where the text is (reasoning or content).
    reasoning: ReasoningStream | None = None
    # The prompt's logprobs (triton_client.Chunk.prompt_logprobs) once they arrived: echo
    # with logprobs puts them before the completion's; whole answers return them as vLLM.
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    """`cached_tokens`: the prompt tokens the prefix cache held, as vLLM reports them with
    --enable-prompt-tokens-details (OpenAI's prompt_tokens_details); None: not reported."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def total_cached(per_prompt: list[int | None]) -> int | None:
    """A batch's cached tokens: the sum over its prompts (vLLM reports one prompt's), None
    when they were not asked for."""
    if not per_prompt or any(n is None for n in per_prompt):
        return None
    return sum(per_prompt)


@dataclass(slots=True)
class OutputFormat:
    model: str
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    id_prefix = ""
    object = ""
    chunk_object = ""
    # A stream chunk is due for a choice's first response even when it has no text (chat
    # announces the assistant role there).
    announces_start = False
    # vLLM's chat returns a request's prompt_logprobs on the response, completions on
    # each choice.
    prompt_logprobs_on_body = False

    def __post_init__(self) -> None:
        self.request_id = self.request_id or f"{self.id_prefix}{uuid.uuid4().hex}"

    def body(self, choices: list[dict[str, Any]], usage_: dict[str, int] | None,
             chunk: bool = False, with_usage: bool = True) -> dict[str, Any]:
        """with_usage=False leaves `usage` out of a chunk: OpenAI sends it (null until the
        last chunk) only when stream_options.include_usage is set."""
        body = {"id": self.request_id, "object": self.chunk_object if chunk else self.object,
                "created": self.created, "model": self.model, "system_fingerprint": None,
                "choices": choices}
        if with_usage or not chunk:
            body["usage"] = usage_
        return body

    def choice(self, index: int, text: str, finish_reason: str | None,
               positions: Positions | None, state: ChoiceState,
               chunk: bool) -> dict[str, Any] | None:
        """None: nothing to send for this choice in this chunk."""
        raise NotImplementedError


@dataclass(slots=True)
class CompletionFormat(OutputFormat):
    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"
    # echo=true: each choice's prompt, by choice index, put before its first text.
    echo: list[str] | None = None
    # echo with logprobs: each choice's first prompt token as text (its position has no
    # logprob; the `llm` model sends null there, as vLLM).
    echo_first_tokens: list[str] | None = None
    # echo with max_tokens 0 (vLLM's): the engine sampled one token, which is not shown.
    echo_only: bool = False

    def choice(self, index: int, text: str, finish_reason: str | None,
               positions: Positions | None, state: ChoiceState, chunk: bool) -> dict[str, Any]:
        if self.echo_only:
            text, positions = "", (None if positions is None else [])
        if self.echo is not None and not state.started:
            if positions is not None:
                positions = self._prompt_positions(index, state) + positions
            text = self.echo[index] + text
        state.started = True
        logprobs = None
        if positions is not None:
            logprobs = completion_logprobs(positions, state.text_offset)
        if logprobs and logprobs["tokens"]:
            # vLLM's rule: the next offset follows the tokens reported, not the text (text
            # held back for a stop string lags them).
            state.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        elif positions is None:
            state.text_offset += len(text)
        body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if not chunk and state.prompt_logprobs is not None:
            body["prompt_logprobs"] = state.prompt_logprobs
        return body

    def _prompt_positions(self, index: int, state: ChoiceState) -> Positions:
        if state.prompt_logprobs is None or self.echo_first_tokens is None:
            raise APIError(500, "the `llm` model sent no prompt_logprobs for echo with "
                           "logprobs (a backend without them?)", code="internal_error")
        return prompt_positions(self.echo_first_tokens[index], state.prompt_logprobs)


@dataclass(slots=True)
class ChatFormat(OutputFormat):
    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    announces_start = True
    prompt_logprobs_on_body = True
    top_logprobs: int = 0
    # The request's tools (openai_frontend/tool_calls.py); None: plain text replies.
    tools: ToolPlan | None = None
    # --reasoning-parser's reading of this request (openai_frontend/reasoning.py); None:
    # no parser, the whole text is content and no reasoning fields are sent.
    reasoning: ReasoningPlan | None = None

    def choice(self, index: int, text: str, finish_reason_: str | None,
               positions: Positions | None, state: ChoiceState,
               chunk: bool) -> dict[str, Any] | None:
        logprobs = None if positions is None else chat_logprobs(positions, self.top_logprobs)
        if not chunk:
            return {"index": index, "message": self._message(text, finish_reason_, state),
                    "logprobs": logprobs, "finish_reason": state.finish_reason}
        # OpenAI's stream: the role in the choice's first delta only; a delta that only
        # finishes the choice is empty.
        delta: dict[str, Any] = {}
        if not state.started:
            delta["role"] = "assistant"
        content, tool_deltas = text, []
        if self.reasoning is not None:
            # First the reasoning: only what follows it is content (and may hold calls).
            state.reasoning = state.reasoning or self.reasoning.stream()
            reasoning, content = state.reasoning.feed(text)
            if finish_reason_ is not None:
                tail_reasoning, tail_content = state.reasoning.finish()
                reasoning, content = reasoning + tail_reasoning, content + tail_content
            if reasoning:
                delta.update(_reasoning_fields(reasoning))
        if self.tools is not None:
            state.tools = state.tools or ToolStream(self.tools)
            content, tool_deltas = state.tools.feed(content)
            if finish_reason_ is not None:
                content += state.tools.flush()
                finish_reason_ = finish_reason(self.tools, finish_reason_, state.tools.called)
        if content or not (state.started or "reasoning" in delta):
            delta["content"] = content
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        if state.started and not delta and finish_reason_ is None and logprobs is None:
            return None  # held back: it may be the start of a tool call
        state.started = True
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason_}

    def _message(self, text: str, reason: str | None, state: ChoiceState) -> dict[str, Any]:
        state.finish_reason = reason
        reasoning: dict[str, Any] = {}
        if self.reasoning is not None:
            thought, text = self.reasoning.split(text)
            reasoning = _reasoning_fields(thought)
        if self.tools is None:
            return {"role": "assistant", "content": text, "refusal": None, "tool_calls": [],
                    **reasoning}
        found = extract(self.tools, text or "")
        state.finish_reason = finish_reason(self.tools, reason, bool(found.calls))
        content = found.content
        if self.tools.kind != "auto":
            content = content or ""  # vLLM's message for named / required
        return {"role": "assistant", "content": content, "refusal": None,
                "tool_calls": message_tool_calls(found.calls), **reasoning}


def _reasoning_fields(text: str | None) -> dict[str, Any]:
    """The reasoning under both names clients read: `reasoning_content` (DeepSeek's API,
    vLLM before its rename) and `reasoning` (vLLM 0.32's)."""
    return {"reasoning_content": text, "reasoning": text}


def completion_logprobs(positions: Positions, text_offset: int) -> dict[str, Any]:
    """OpenAI's legacy shape. top_logprobs holds every token the engine returned for the
    position (the requested top ones plus the sampled one), as OpenAI and vLLM do; tokens
    with the same text keep the higher logprob."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for position in positions:
        token, logprob = position[0]
        tokens.append(token)
        token_logprobs.append(logprob)
        offsets.append(text_offset)
        text_offset += len(token)
        if logprob is None:  # the prompt's first token: nothing to rank
            top.append(None)
            continue
        alternatives: dict[str, float] = {}
        for text, value in position:
            alternatives[text] = max(value, alternatives.get(text, value))
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def prompt_positions(first_token: str,
                     prompt_logprobs: list[dict[str, dict[str, Any]] | None]) -> Positions:
    """The `llm` model's prompt_logprobs as Positions: the first token with no logprob,
    then per position the prompt's token and its top-k, in the order sent (prompt first)."""
    positions: Positions = [[(first_token, None)]]
    for position in prompt_logprobs[1:]:
        positions.append([(info.get("decoded_token", ""), float(info["logprob"]))
                          for info in (position or {}).values()])
    return positions


def chat_logprobs(positions: Positions, top_logprobs: int) -> dict[str, Any]:
    content = []
    for position in positions:
        token, logprob = position[0]
        ranked = sorted(position, key=lambda item: -item[1])[:top_logprobs]
        content.append({**_token_logprob(token, logprob),
                        "top_logprobs": [_token_logprob(t, v) for t, v in ranked]})
    return {"content": content, "refusal": None}


def _token_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
