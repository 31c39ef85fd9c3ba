"""Run one OpenAI request on Triton: one `llm` request per prompt (a completions batch
sends several), their responses merged, and the whole (non-streaming) answer built.

Choice indices follow OpenAI's rule for a batch: prompt p's sequence i is choice p * n + i."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from openai_frontend.errors import APIError
from openai_frontend.mapping import TritonRequest
from openai_frontend.prompts import Prompt
from openai_frontend.responses import ChoiceState, OutputFormat, total_cached, usage
from openai_frontend.triton_client import Chunk, TritonLLM

_DONE = object()


async def responses(llm: TritonLLM, request: TritonRequest) -> AsyncIterator[tuple[int, Chunk]]:
    """(prompt index, Chunk) as Triton answers. The first error ends the iteration (raised
    as APIError) and cancels the prompts still running; so does closing the iterator."""
    if len(request.prompts) == 1:
        async for chunk in llm.generate(request.prompts[0], request.sampling, request.stream,
                                        request.logprobs):
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, prompt: Prompt) -> None:
        try:
            async for chunk in llm.generate(prompt, request.sampling, request.stream,
                                            request.logprobs):
                await queue.put((index, chunk))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which answers it
            await queue.put((index, exc if isinstance(exc, APIError) else
                             APIError(500, f"{type(exc).__name__}: {exc}", code="internal_error")))
        finally:
            await queue.put((index, _DONE))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(request.prompts)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def complete(llm: TritonLLM, request: TritonRequest, fmt: OutputFormat) -> dict:
    """The non-streaming answer: each prompt's single (final) response."""
    finals: dict[int, Chunk] = {}
    async for index, chunk in responses(llm, request):
        finals[index] = chunk
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, []
    for p in range(len(request.prompts)):
        chunk = finals.get(p)
        if chunk is None:
            raise APIError(500, f"Triton sent no response for prompt {p}", code="internal_error")
        prompt_tokens += chunk.num_input_tokens
        cached.append(chunk.num_cached_tokens)
        completion_tokens += sum(chunk.num_output_tokens)
        n = len(chunk.texts)
        for i, text in enumerate(chunk.texts):
            positions = chunk.logprobs[i] if chunk.logprobs is not None else None
            choices.append(fmt.choice(p * n + i, text, chunk.finish_reasons[i], positions,
                                      ChoiceState(prompt_logprobs=chunk.prompt_logprobs),
                                      chunk=False))
    body = fmt.body(choices, usage(prompt_tokens, completion_tokens, total_cached(cached)))
    if fmt.prompt_logprobs_on_body and "prompt_logprobs" in request.sampling:
        body["prompt_logprobs"] = finals[0].prompt_logprobs
    return body
