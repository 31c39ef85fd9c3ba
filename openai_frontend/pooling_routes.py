"""/v1/embeddings, /score (and /v1/score) and /rerank (and /v1/rerank, /v2/rerank) over a
pooling `llm` model: one Triton request per input or pair, all at once, the first error
cancelling the others (as a completions batch does, openai_frontend/generation.py)."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from starlette.responses import Response

from openai_frontend.errors import APIError, bad_request, model_not_found
from openai_frontend.limits import ClientGone, unless_disconnected
from openai_frontend.pooling import (cosine, embedding_body, pooling_payload, rerank_body,
                                     score_body, score_pairs, split_inputs)
from openai_frontend.pooling_protocol import (EmbeddingRequest, RerankRequest, ScoreRequest,
                                              PoolingFields)
from openai_frontend.triton_client import TritonLLM

# Fragment of the refusal a model that is not a cross-encoder gives a text pair
# (engine/pooling/inputs.py): its score is then the cosine of two embeddings, as vLLM's.
_NOT_A_CROSS_ENCODER = "cross-encoder's input"


async def all_or_none(work: list[Awaitable[Any]]) -> list[Any]:
    """Every result in order, or the first error with the rest cancelled (their Triton
    requests with them)."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def install(app: FastAPI, served_model_name: str, max_inputs: int,
            on_client_gone: Callable[[], None]) -> None:
    """`max_inputs`: --max-sequences-per-request, the most `llm` requests one body makes."""

    def model_of(body: PoolingFields) -> str:
        name = body.model if body.model is not None else served_model_name
        # Only the base model: a LoRA adapter's name would pool with the base's weights.
        if name != served_model_name:
            raise model_not_found(name)
        return name

    def check_count(count: int, field: str) -> None:
        if count > max_inputs:
            raise bad_request(f"{count} inputs; this server takes at most {max_inputs} per "
                              "request (--max-sequences-per-request)", field)

    async def answered(request: Request, work: Awaitable[Any]):
        try:
            return await unless_disconnected(request, work)
        except ClientGone:
            on_client_gone()
            return Response(status_code=499)  # nobody reads it

    def pool(request: Request, body: PoolingFields, item: Any, **params: Any):
        llm: TritonLLM = request.app.state.llm
        payload = pooling_payload(item, truncate_prompt_tokens=body.truncate_prompt_tokens,
                                  use_activation=body.use_activation, **params)
        return llm.pool(payload, body.priority)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        name = model_of(body)
        inputs = split_inputs(body.input)
        check_count(len(inputs), "input")

        async def work():
            answers = await all_or_none([pool(request, body, item, dimensions=body.dimensions)
                                         for item in inputs])
            return embedding_body(name, [v for v, _ in answers], sum(n for _, n in answers),
                                  body.encoding_format)
        return await answered(request, work())

    async def scores(request: Request, body: PoolingFields, pairs: list[tuple[str, str]]
                     ) -> tuple[list[float], int]:
        """One score per pair: the cross-encoder's own, else the embeddings' cosine. Which
        kind the model is shows on the first pair it is sent, remembered after."""
        state = request.app.state
        answers: list[tuple[list[float], int]] = []
        if getattr(state, "score_by_cosine", None) is None:  # not known yet
            try:
                answers = await all_or_none([pool(request, body, list(p)) for p in pairs[:1]])
                state.score_by_cosine = False
            except APIError as exc:
                if exc.status != 400 or _NOT_A_CROSS_ENCODER not in exc.message:
                    raise
                state.score_by_cosine = True
        if not state.score_by_cosine:
            answers += await all_or_none([pool(request, body, list(p))
                                          for p in pairs[len(answers):]])
            return [v[0] for v, _ in answers], sum(n for _, n in answers)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        vectors = await all_or_none([pool(request, body, t) for t in texts])
        by_text = dict(zip(texts, vectors))
        return ([cosine(by_text[a][0], by_text[b][0]) for a, b in pairs],
                sum(n for _, n in vectors))

    async def score(body: ScoreRequest, request: Request):
        name = model_of(body)
        pairs = score_pairs(body.text_1, body.text_2)
        check_count(len(pairs), "text_2")

        async def work():
            values, tokens = await scores(request, body, pairs)
            return score_body(name, values, tokens)
        return await answered(request, work())

    async def rerank(body: RerankRequest, request: Request):
        name = model_of(body)
        pairs = score_pairs(body.query, body.documents, ("query", "documents"))
        check_count(len(pairs), "documents")

        async def work():
            values, tokens = await scores(request, body, pairs)
            return rerank_body(name, body.documents, values, body.top_n, tokens)
        return await answered(request, work())

    for path in ("/score", "/v1/score"):
        app.post(path)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(rerank)
