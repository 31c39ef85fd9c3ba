"""The FastAPI app: OpenAI's routes over the `llm` model, and errors as OpenAI error objects."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.responses import Response
from starlette.exceptions import HTTPException

from openai_frontend import pooling_routes, runtime_lora, tokenizer_info
from openai_frontend.auth import ApiKeyMiddleware
from openai_frontend.chat import render_chat
from openai_frontend.errors import APIError, bad_request, model_not_found
from openai_frontend.generation import complete
from openai_frontend.limits import BodyLimitMiddleware, ClientGone, unless_disconnected
from openai_frontend.mapping import chat_request, completion_request
from openai_frontend.metrics_proxy import RouteMetrics, metrics_response
from openai_frontend.options import FrontendOptions
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest
from openai_frontend.reasoning import ReasoningParser
from openai_frontend.responses import ChatFormat, CompletionFormat, OutputFormat
from openai_frontend.served_adapters import ServedAdapters
from openai_frontend.streaming import stream_response
from openai_frontend.tokenization import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from openai_frontend.tool_calls import plan_tools
from openai_frontend.triton_client import TritonLLM

log = logging.getLogger("openai_frontend")


def create_app(triton_url: str, model: str, served_model_name: str, tokenizer: Any,
               options: FrontendOptions | None = None) -> FastAPI:
    options = options or FrontendOptions()
    route_metrics = RouteMetrics()
    # Tokenizing and chat templates take CPU seconds on a large body: never on the loop.
    tokenizer_pool = ThreadPoolExecutor(options.tokenizer_threads, thread_name_prefix="tokenizer")

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(
            tokenizer_pool, functools.partial(fn, *args))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        import aiohttp

        # The asyncio gRPC channel and the HTTP session belong to the event loop they
        # are made in: uvicorn's.
        app.state.llm = TritonLLM(triton_url, model, options.triton_admin_key,
                                  cached_tokens=options.prompt_tokens_details)
        app.state.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        try:
            yield
        finally:
            tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            await app.state.llm.close()
            await app.state.http.close()

    app = FastAPI(title="triton-llm-engine OpenAI-compatible API", lifespan=lifespan)
    app.state.route_metrics = route_metrics
    created = int(time.time())
    _install_error_handlers(app)
    if options.api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=options.api_keys)
    # Added last, so outermost: nothing reads a body past the limit.
    app.add_middleware(BodyLimitMiddleware, limit=options.max_request_bytes)

    adapters = ServedAdapters(options.lora_modules)
    reasoning = (None if options.reasoning_parser is None
                 else ReasoningParser.for_tokenizer(options.reasoning_parser, tokenizer))

    def model_card(name: str = served_model_name) -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": created,
                "owned_by": "triton-llm-engine", "root": model}
        if name in adapters:  # vLLM's adapter cards: the folder as root, the base as parent
            adapter = adapters.get(name)
            card.update(root=adapter.path, parent=adapter.base_model_name or served_model_name)
        return card

    def check_model(name: str | None) -> None:
        if name != served_model_name and name not in adapters:
            raise model_not_found(name)

    def with_adapter(triton_request, name: str):
        """The adapter a model id names rides to Triton as vllm_backend's lora_name."""
        if name in adapters:
            triton_request.sampling.update(adapters.sampling(name))
        return triton_request

    async def max_model_len(request: Request) -> int:
        """The limit the `llm` model enforces (its engine's resolved max_model_len, asked
        of it once), unless --max-model-len overrides it."""
        if options.max_model_len is not None:
            return options.max_model_len
        if getattr(request.app.state, "max_model_len", None) is None:
            request.app.state.max_model_len = await request.app.state.llm.max_model_len()
        return request.app.state.max_model_len

    def check_sequences(num_prompts: int, n: int | None) -> None:
        limit = options.max_sequences_per_request
        if num_prompts * (n or 1) > limit:
            raise bad_request(
                f"{num_prompts} prompt(s) x n={n or 1} asks for {num_prompts * (n or 1)} "
                f"sequences; this server takes at most {limit} per request "
                "(--max-sequences-per-request)", "prompt" if num_prompts > 1 else "n")

    def stalled() -> None:
        route_metrics.cancelled["stream_not_read"] += 1

    async def answer(request: Request, triton_request, fmt: OutputFormat):
        """The answer, or the Triton requests cancelled as soon as the client leaves
        (while a whole answer is being made, or before a stream's first event)."""
        llm: TritonLLM = request.app.state.llm
        if triton_request.stream:
            work = stream_response(llm, triton_request, fmt, options.stream_idle_timeout,
                                   stalled)
        else:
            work = complete(llm, triton_request, fmt)
        try:
            return await unless_disconnected(request, work)
        except ClientGone:
            route_metrics.cancelled["client_disconnected"] += 1
            return Response(status_code=499)  # nobody reads it

    @app.get("/health")
    async def health(request: Request):
        if await request.app.state.llm.ready():
            return JSONResponse({})
        raise APIError(503, f"model {model!r} is not ready on Triton at {triton_url}",
                       code="service_unavailable")

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(), *map(model_card, adapters)]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        check_model(name)
        return model_card(name)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        triton_request = with_adapter(completion_request(body), body.model)
        check_sequences(len(triton_request.prompts), body.n)
        fmt = CompletionFormat(body.model)
        if body.echo:
            # An id prompt echoes as /detokenize decodes it (vLLM's echo of a token prompt).
            texts = [p if isinstance(p, str) else await off_loop(tokenizer.decode, p)
                     for p in triton_request.prompts]
            fmt.echo = per_choice(texts, body.n)
            fmt.echo_only = body.max_tokens == 0
            if body.logprobs is not None:
                firsts = [await off_loop(first_token, tokenizer, p) for p in triton_request.prompts]
                fmt.echo_first_tokens = per_choice(firsts, body.n)
        return await answer(request, triton_request, fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        plan, constraint = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                                      options.tool_calls)
        check_sequences(1, body.n)
        prompt = await off_loop(render_chat, tokenizer, body.messages, body.add_generation_prompt,
                                body.continue_final_message, body.chat_template_kwargs,
                                body.tools)
        keep_special = ((plan is not None and plan.keeps_special_tokens)
                        or (reasoning is not None and reasoning.keeps_special_tokens))
        triton_request = with_adapter(chat_request(body, prompt, constraint,
                                                   keep_special_tokens=keep_special), body.model)
        reading = None if reasoning is None else reasoning.plan(
            prompt, body.chat_template_kwargs,
            constrained="structured_outputs" in triton_request.sampling)
        return await answer(request, triton_request,
                            ChatFormat(body.model, top_logprobs=body.top_logprobs or 0,
                                       tools=plan, reasoning=reading))

    def client_gone() -> None:
        route_metrics.cancelled["client_disconnected"] += 1

    pooling_routes.install(app, served_model_name, options.max_sequences_per_request,
                           client_gone)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest, request: Request):
        if body.model is not None:
            check_model(body.model)
        return await off_loop(tokenize, tokenizer, body, await max_model_len(request))

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        if body.model is not None:
            check_model(body.model)
        return await off_loop(detokenize, tokenizer, body)

    if options.tokenizer_info:
        tokenizer_info.install(app, tokenizer)

    if options.runtime_lora_updating:
        log.warning("LoRA loading and unloading at run time is on (%s): any client may "
                    "make the server read a folder", runtime_lora.ENV_VAR)
        runtime_lora.install(app, adapters, served_model_name)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics(request: Request):
        return await metrics_response(request.app.state.http, options.triton_metrics_url,
                                      route_metrics)

    return app


def per_choice(values: list, n: int | None) -> list:
    """Per prompt -> per choice (prompt p's sample i is choice p * n + i)."""
    return [value for value in values for _ in range(n or 1)]


def first_token(tokenizer: Any, prompt) -> str:
    """The prompt's first token as text, decoded alone as vLLM decodes it for echo's
    logprobs. A text is tokenized as the `llm` model tokenizes it (special tokens added)."""
    ids = prompt if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
    return tokenizer.decode(ids[:1])


def _version() -> str:
    try:
        return metadata.version("triton-llm-engine")
    except metadata.PackageNotFoundError:
        return "unknown"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError):
        # FastAPI says 422; OpenAI and its clients expect 400 for a malformed request.
        error = validation_error(exc.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException):
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        log.exception("unexpected error")
        return JSONResponse(APIError(500, f"{type(exc).__name__}: {exc}",
                                     code="internal_error").body(), status_code=500)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """pydantic's errors on a request body -> one 400 naming the first field at fault."""
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        return bad_request(f"request body is not valid JSON: {detail.get('ctx', {}).get('error', '')}")
    fields = [".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body" for e in errors]
    message = "; ".join(f"{f}: {e.get('msg', '')}" for f, e in zip(fields, errors))
    first = fields[0].split(".")[0] if fields else None
    return bad_request(message or "invalid request body", None if first == "body" else first)
