"""The `llm` model over Triton's gRPC streaming API (tritonclient's asyncio client).

Every request goes on its own stream: a decoupled model cannot be called with the unary
ModelInfer, and a stream error names no request, so one stream per request is what lets an
error reach the right HTTP response. Streams share the client's one channel."""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from backend.restricted_api import grpc_headers
from openai_frontend.errors import APIError, from_triton
from openai_frontend.prompts import Prompt


@dataclass(slots=True)
class Chunk:
    """One `llm` response: one entry per sequence (n of them)."""
    texts: list[str]
    finish_reasons: list[str | None]
    num_input_tokens: int
    num_output_tokens: list[int]
    # Per sequence, per new token: [(token text, logprob), ...], the sampled token first.
    logprobs: list[list[list[tuple[str, float]]]] | None
    final: bool
    # Prompt tokens the prefix cache held; None when not asked (--no-enable-prompt-tokens-details).
    num_cached_tokens: int | None = None
    # sampling "prompt_logprobs" (first response only): vLLM's layout, None for the first
    # position, then {"<token id>": {"logprob", "rank", "decoded_token"}}, prompt token first.
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


_TRITON_TYPES = {np.dtype(np.object_): "BYTES", np.dtype(np.bool_): "BOOL",
                 np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32"}


def request_inputs(prompt: Prompt, sampling: dict[str, Any], stream: bool, logprobs: bool,
                   cached_tokens: bool = False) -> list[grpcclient.InferInput]:
    """A text goes as text_input, token ids as prompt_token_ids (INT64, as `llm` declares)."""
    if isinstance(prompt, str):
        tensors = {"text_input": np.array([prompt.encode("utf-8")], dtype=np.object_)}
    else:
        tensors = {"prompt_token_ids": np.array(prompt, dtype=np.int64)}
    tensors.update({
        "sampling_parameters": np.array([json.dumps(sampling).encode("utf-8")], dtype=np.object_),
        "stream": np.array([stream]),
        "exclude_input_in_output": np.array([True]),
        "return_finish_reason": np.array([True]),
        "return_num_input_tokens": np.array([True]),
        "return_num_output_tokens": np.array([True]),
    })
    if logprobs:
        tensors["return_logprobs"] = np.array([True])
    if cached_tokens:
        tensors["return_num_cached_tokens"] = np.array([True])
    return infer_inputs(tensors)


def infer_inputs(tensors: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), _TRITON_TYPES[array.dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def parse_response(outputs: dict[str, np.ndarray], final: bool) -> Chunk:
    texts = [t.decode("utf-8") for t in outputs["text_output"].reshape(-1)]
    # The backend sends str(None) for a sequence still running, as vllm_backend does.
    reasons = [None if r.decode() == "None" else r.decode()
               for r in outputs["finish_reason"].reshape(-1)]
    logprobs = None
    if "logprobs" in outputs:
        logprobs = [[[(info.get("decoded_token", ""), float(info["logprob"]))
                      for info in position.values()] for position in json.loads(raw)]
                    for raw in outputs["logprobs"].reshape(-1)]
    cached = outputs.get("num_cached_tokens")
    prompt_logprobs = None
    if "prompt_logprobs" in outputs:
        prompt_logprobs = clamp_logprobs(json.loads(outputs["prompt_logprobs"].reshape(-1)[0]))
    return Chunk(texts, reasons, int(outputs["num_input_tokens"].reshape(-1)[0]),
                 [int(n) for n in outputs["num_output_tokens"].reshape(-1)], logprobs, final,
                 None if cached is None else int(cached.reshape(-1)[0]), prompt_logprobs)


# OpenAI's (and vLLM's) stand-in for -inf, which JSON cannot carry.
LOGPROB_FLOOR = -9999.0


def clamp_logprobs(positions: list[dict[str, dict[str, Any]] | None]
                   ) -> list[dict[str, dict[str, Any]] | None]:
    for position in positions:
        for info in (position or {}).values():
            info["logprob"] = max(float(info["logprob"]), LOGPROB_FLOOR)
    return positions


# gRPC's reconnect backoff grows to 120 s while tritonserver is down (a restart, a
# rolling update), and every request in it fails at once: the route then answered 503
# for up to two minutes after Triton was back. Capped at 1 s it is back within a second.
RECONNECT_BACKOFF = [("grpc.initial_reconnect_backoff_ms", 250),
                     ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


def channel_args() -> list[tuple[str, int]]:
    """tritonclient's own defaults (message sizes, keepalive) plus the backoff cap."""
    keepalive = grpcclient.KeepAliveOptions()
    return [("grpc.max_send_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", grpcclient.MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            *RECONNECT_BACKOFF]


class TritonLLM:
    def __init__(self, url: str, model: str, admin_key: str | None = None,
                 cached_tokens: bool = False) -> None:
        """`cached_tokens`: ask every request's num_cached_tokens (usage's
        prompt_tokens_details)."""
        self.url = url
        self.model = model
        self._cached_tokens = cached_tokens
        self._grpc_headers = grpc_headers(admin_key)
        self._client = grpcaio.InferenceServerClient(url, channel_args=channel_args())

    async def close(self) -> None:
        await self._client.close()

    async def ready(self, timeout: float = 2.0) -> bool:
        try:
            return bool(await self._client.is_model_ready(self.model, client_timeout=timeout))
        except Exception:  # noqa: BLE001 - unreachable, timed out, ...: not ready either way
            return False

    async def model_parameter(self, name: str, timeout: float = 5.0) -> str | None:
        """A parameter of the model's config (config.pbtxt `parameters`), None if unset."""
        try:
            reply = await self._client.get_model_config(self.model, as_json=True,
                                                        headers=self._grpc_headers,
                                                        client_timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - tritonclient raises its own exception type
            raise from_triton(exc) from None
        value = reply.get("config", {}).get("parameters", {}).get(name, {}).get("string_value")
        return value or None

    async def max_model_len(self) -> int:
        """The engine's resolved max_model_len, the limit the model enforces: `llm` answers
        a request that holds only return_max_model_len at once, without the engine."""
        inputs = infer_inputs({"return_max_model_len": np.array([True])})
        value = None
        async with contextlib.aclosing(self._infer(inputs)) as responses:
            async for outputs, _ in responses:
                value = outputs.get("max_model_len", value)
        if value is None:
            raise APIError(500, f"model {self.model!r} sent no max_model_len",
                           code="internal_error")
        return int(value.reshape(-1)[0])

    async def generate(self, prompt: Prompt, sampling: dict[str, Any], stream: bool,
                       logprobs: bool) -> AsyncIterator[Chunk]:
        """The request's responses as Chunks, ending with the final one. A Triton error
        is raised as APIError. Closing the iterator early (the HTTP client left) cancels
        the request, so the engine frees its KV blocks at once."""
        inputs = request_inputs(prompt, sampling, stream, logprobs, self._cached_tokens)
        # Closed with this generator, so its stream is cancelled at once, not when collected.
        async with contextlib.aclosing(self._infer(inputs)) as responses:
            async for outputs, final in responses:
                yield parse_response(outputs, final)

    async def pool(self, payload: dict[str, Any], priority: int | None = None
                   ) -> tuple[list[float], int]:
        """A pooling model's answer to one `embedding_request` (docs/INTERFACE.md): (its
        vector, the prompt's tokens). A generation model refuses it, naming `runner`."""
        tensors = {"embedding_request": np.array([json.dumps(payload).encode("utf-8")],
                                                 dtype=np.object_),
                   "return_num_input_tokens": np.array([True])}
        if priority is not None:
            tensors["priority"] = np.array([priority], dtype=np.int32)
        vector, tokens = None, 0
        async with contextlib.aclosing(self._infer(infer_inputs(tensors))) as responses:
            async for outputs, _ in responses:
                if "text_output" in outputs:
                    vector = json.loads(outputs["text_output"].reshape(-1)[0])
                if "num_input_tokens" in outputs:
                    tokens = int(outputs["num_input_tokens"].reshape(-1)[0])
        if not isinstance(vector, list):
            raise APIError(500, f"model {self.model!r} sent no vector", code="internal_error")
        return [float(v) for v in vector], tokens

    async def _infer(self, inputs: list[grpcclient.InferInput]
                     ) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:
        """One request on its own stream: each response's outputs (responses without any
        skipped) and whether it is the final one."""
        request = {"model_name": self.model, "inputs": inputs}

        async def one_request():
            yield request

        try:
            responses = self._client.stream_infer(one_request())
        except Exception as exc:  # noqa: BLE001 - tritonclient raises its own exception type
            raise from_triton(exc) from None
        finished = False
        try:
            while not finished:
                try:
                    result, error = await responses.__anext__()
                except StopAsyncIteration:
                    raise APIError(500, "Triton closed the stream before the final response",
                                   code="internal_error") from None
                except Exception as exc:  # noqa: BLE001 - grpc errors, connection loss
                    raise from_triton(exc) from None
                if error is not None:
                    finished = True
                    raise from_triton(error)
                response = result.get_response()
                finished = response.parameters["triton_final_response"].bool_param
                outputs = {out.name: result.as_numpy(out.name) for out in response.outputs}
                if outputs:
                    yield outputs, finished
        finally:
            if not finished:
                responses.cancel()
