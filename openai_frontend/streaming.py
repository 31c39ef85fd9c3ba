"""Server-Sent Events for `stream: true`, in OpenAI's framing: one `data: {chunk}` event
per Triton response that adds something, an optional usage chunk, then `data: [DONE]`."""
from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from openai_frontend.errors import APIError
from openai_frontend.generation import responses
from openai_frontend.mapping import TritonRequest
from openai_frontend.responses import ChoiceState, OutputFormat, total_cached, usage
from openai_frontend.triton_client import Chunk, TritonLLM

log = logging.getLogger("openai_frontend")


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class _Stalled(Exception):
    pass


class GuardedStream(StreamingResponse):
    """A StreamingResponse whose events are given up on when one send stays blocked for
    `idle_timeout` seconds: the client has stopped reading and the socket's buffers are
    full. The events' iterator is then closed, which cancels the Triton requests behind
    it, and the connection is dropped. The iterator is closed on every way out, so a
    client that disconnects frees its requests at once too."""

    def __init__(self, content: AsyncIterator[str], idle_timeout: float | None,
                 on_stalled: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._events = content
        self._idle_timeout = idle_timeout
        self._on_stalled = on_stalled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self._idle_timeout

        async def guarded_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise _Stalled() from None

        try:
            await super().__call__(scope, receive, send if timeout is None else guarded_send)
        except _Stalled:
            # Returning with the response unfinished makes uvicorn close the connection.
            log.warning("stream not read for %s s: cancelled (--stream-idle-timeout)", timeout)
            self._on_stalled()
        finally:
            await self._events.aclose()


async def stream_response(llm: TritonLLM, request: TritonRequest, fmt: OutputFormat,
                          idle_timeout: float | None = None,
                          on_stalled: Callable[[], None] = lambda: None) -> StreamingResponse:
    """Waits for Triton's first response before answering, so a request Triton refuses
    (a bad parameter, server busy) gets its HTTP error status rather than a 200 stream
    that carries the error."""
    source = responses(llm, request)
    try:
        first = await source.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await source.aclose()
        raise
    return GuardedStream(events(first, source, request, fmt), idle_timeout, on_stalled,
                         media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def events(first: tuple[int, Chunk] | None, rest: AsyncIterator[tuple[int, Chunk]],
                 request: TritonRequest, fmt: OutputFormat) -> AsyncIterator[str]:
    states: dict[int, ChoiceState] = defaultdict(ChoiceState)
    # Per prompt: (prompt tokens, cached prompt tokens), from its latest response.
    prompt_tokens: dict[int, tuple[int, int | None]] = {}
    try:
        if first is not None:
            event = _chunk_event(*first, states, prompt_tokens, request, fmt)
            if event:
                yield event
            async for index, chunk in rest:
                event = _chunk_event(index, chunk, states, prompt_tokens, request, fmt)
                if event:
                    yield event
        if request.include_usage:
            completion_tokens = sum(s.completion_tokens for s in states.values())
            counts = list(prompt_tokens.values())
            body = usage(sum(n for n, _ in counts), completion_tokens,
                         total_cached([cached for _, cached in counts]))
            yield sse(fmt.body([], body, chunk=True))
    except APIError as exc:
        # Mid-stream the status is already 200: the error travels as an event, which
        # the openai client raises as APIError.
        yield sse(exc.body())
    finally:
        await rest.aclose()
    yield sse("[DONE]")


def _chunk_event(prompt_index: int, chunk: Chunk, states: dict[int, ChoiceState],
                 prompt_tokens: dict[int, tuple[int, int | None]], request: TritonRequest,
                 fmt: OutputFormat) -> str | None:
    prompt_tokens[prompt_index] = (chunk.num_input_tokens, chunk.num_cached_tokens)
    n = len(chunk.texts)
    choices = []
    for i, text in enumerate(chunk.texts):
        state = states[prompt_index * n + i]
        if chunk.prompt_logprobs is not None:  # sent once, with the first response
            state.prompt_logprobs = chunk.prompt_logprobs
        if state.finish_reason is not None:
            continue  # n > 1: a finished sequence still has (empty) entries
        state.completion_tokens += chunk.num_output_tokens[i]
        reason = chunk.finish_reasons[i]
        positions = chunk.logprobs[i] if chunk.logprobs is not None else None
        # A token whose text is held back (a stop string may follow, a character is cut)
        # still goes out when it has logprobs, as vLLM sends it: else echo's prompt
        # logprobs, or the token's own, would wait or be lost.
        if not text and reason is None and not positions \
                and (state.started or not fmt.announces_start):
            continue
        state.finish_reason = reason
        choice = fmt.choice(prompt_index * n + i, text, reason, positions, state, chunk=True)
        if choice is not None:
            choices.append(choice)
    if not choices:
        return None
    return sse(fmt.body(choices, None, chunk=True, with_usage=request.include_usage))
