"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, registered only under
VLLM_ALLOW_RUNTIME_LORA_UPDATING (else they are 404s, as in vLLM), with vLLM 0.32's
bodies, status codes, error types and success texts (its OpenAIServingModels).

A load is checked the way vLLM's add_lora checks it, by the engine itself: a one-token
request with the adapter's name and folder, which the `llm` model (with
allow_runtime_lora_updating) loads as it admits it; a folder that is no PEFT adapter for
its base model is refused there, alone, and the name is not served."""
from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Awaitable, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from openai_frontend.errors import APIError
from openai_frontend.lora_modules import LoRAModule
from openai_frontend.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from openai_frontend.served_adapters import ServedAdapters

ENV_VAR = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# What engine/lora/adapter.py says of a folder that is missing or lacks a PEFT file: vLLM
# answers those 404 (its LoRAAdapterNotFoundError), any other load failure 500.
_NOT_FOUND = ("folder does not exist", "no adapter_config.json", "no adapter_model.safetensors")
PROBE_PROMPT = "Hi"

# Awaited with (name, folder): returns once the adapter ran, or raises the APIError the
# `llm` model answered.
Probe = Callable[[str, str], Awaitable[None]]


def runtime_updating(environ) -> bool:
    """vLLM's reading of the variable."""
    return environ.get(ENV_VAR, "0").strip().lower() in ("1", "true")


def vllm_error(message: str, err_type: str, status: HTTPStatus) -> JSONResponse:
    """vLLM's ErrorResponse: its own error types, the status as an integer code."""
    return JSONResponse({"error": {"message": message, "type": err_type, "param": None,
                                   "code": status.value}}, status_code=status.value)


def llm_probe(app: FastAPI) -> Probe:
    """The one-token run on the app's `llm` model (app.state.llm, made at start-up)."""
    async def probe(name: str, path: str) -> None:
        sampling = {"max_tokens": 1, "temperature": 0, "lora_name": name, "lora_path": path}
        async for _ in app.state.llm.generate(PROBE_PROMPT, sampling, stream=False,
                                              logprobs=False):
            pass
    return probe


def install(app: FastAPI, adapters: ServedAdapters, base_model: str,
            probe: Probe | None = None) -> None:
    probe = probe or llm_probe(app)
    # vLLM locks per name; one lock here: a load is one engine step long.
    lock = asyncio.Lock()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        name, path = body.lora_name, body.lora_path
        async with lock:
            refusal = _check_load(body, adapters, base_model)
            if refusal is not None:
                return refusal
            try:
                await probe(name, path)
            except APIError as exc:
                return _load_failure(name, path, exc)
            adapters.add(LoRAModule(name, path))
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        name = body.lora_name
        async with lock:
            if not name:
                return vllm_error("'lora_name' needs to be provided to unload a LoRA adapter.",
                                  "InvalidUserInput", HTTPStatus.BAD_REQUEST)
            if name not in adapters:
                return vllm_error(f"The lora adapter '{name}' cannot be found.",
                                  "NotFoundError", HTTPStatus.NOT_FOUND)
            # As vLLM: requests already running keep their adapter; new ones cannot name it.
            adapters.remove(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)


def _check_load(body: LoadLoRAAdapterRequest, adapters: ServedAdapters,
                base_model: str) -> JSONResponse | None:
    name = body.lora_name
    if not name or not body.lora_path:
        return vllm_error("Both 'lora_name' and 'lora_path' must be provided.",
                          "InvalidUserInput", HTTPStatus.BAD_REQUEST)
    if name == base_model:
        return vllm_error(f"The lora adapter '{name}' conflicts with a served base model.",
                          "InvalidUserInput", HTTPStatus.BAD_REQUEST)
    if body.is_3d_lora_weight:
        return vllm_error("is_3d_lora_weight (fused MoE adapter weights) is not supported: "
                          "this engine serves dense models", "InvalidUserInput",
                          HTTPStatus.BAD_REQUEST)
    if name in adapters and not body.load_inplace:
        return vllm_error(f"The lora adapter '{name}' has already been loaded. If you want to "
                          "load the adapter in place, set 'load_inplace' to True.",
                          "InvalidUserInput", HTTPStatus.BAD_REQUEST)
    if name in adapters and adapters.get(name).path == body.lora_path:
        # vLLM reads the folder again; here the engine keys loaded weights by (name,
        # folder) and keeps them, so changed files there would never be read.
        return vllm_error(f"The lora adapter '{name}' is already loaded from "
                          f"{body.lora_path}: load changed weights from a new folder.",
                          "InvalidUserInput", HTTPStatus.BAD_REQUEST)
    return None


def _load_failure(name: str, path: str, exc: APIError) -> JSONResponse:
    if exc.status >= 500:  # Triton unreachable or failing: not the adapter's fault
        return vllm_error(exc.message, "InternalServerError"
                          if exc.status == 500 else "ServiceUnavailableError",
                          HTTPStatus(exc.status))
    if any(fragment in exc.message for fragment in _NOT_FOUND):
        return vllm_error(f"Loading lora {name} failed: No adapter found for {path}",
                          "NotFoundError", HTTPStatus.NOT_FOUND)
    return vllm_error(exc.message, "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR)
