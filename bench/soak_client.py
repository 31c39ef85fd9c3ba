"""asyncio gRPC streaming client for the soak bench.

tritonclient's sync `start_stream` costs a thread per stream and its aio client cannot ask
for the empty final response (the only way a decoupled model says "done"), so requests are
built straight from Triton's protobufs and every stream is a coroutine on one event loop:
thousands of concurrent requests cost the 2-core host one thread."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

_DATATYPES = {np.dtype(np.object_): "BYTES", np.dtype(np.bool_): "BOOL", np.dtype(np.int32): "INT32"}
# tritonclient's defaults: a multi-megabyte prompt must leave the client to be refused.
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 2**31 - 1),
                    ("grpc.max_receive_message_length", 2**31 - 1)]


def llm_tensors(prompt: str | bytes, sampling: dict[str, Any] | str | None = None,
                stream: bool = True, exclude_input_in_output: bool = True) -> dict[str, np.ndarray]:
    """Inputs of the `llm` model; a str `sampling` is sent verbatim (invalid JSON included)."""
    text = prompt.encode() if isinstance(prompt, str) else prompt
    tensors = {"text_input": np.array([text], dtype=np.object_),
               "stream": np.array([stream], dtype=np.bool_),
               "exclude_input_in_output": np.array([exclude_input_in_output], dtype=np.bool_)}
    if sampling is not None:
        raw = sampling if isinstance(sampling, str) else json.dumps(sampling)
        tensors["sampling_parameters"] = np.array([raw.encode()], dtype=np.object_)
    return tensors


def encode_request(model: str, request_id: str, tensors: dict[str, np.ndarray]
                   ) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    message.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, array in tensors.items():
        message.inputs.add(name=name, datatype=_DATATYPES[array.dtype], shape=list(array.shape))
        raw = serialize_byte_tensor(array).item() if array.dtype == np.object_ else array.tobytes()
        message.raw_input_contents.append(raw)
    return message


@dataclass(slots=True)
class CancelPlan:
    """Cancel the stream once `after_responses` responses arrived (0: `delay_s` after the send)."""
    after_responses: int
    delay_s: float = 0.0


@dataclass(slots=True)
class Outcome:
    request_id: str
    sent_at: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # responses that carried text
    pieces: list[str] = field(default_factory=list)
    final: bool = False
    error: str | None = None
    error_at: float = 0.0
    cancelled: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


@dataclass(slots=True)
class StreamJob:
    """Requests multiplexed on one gRPC stream (distinct ids)."""
    messages: list[service_pb2.ModelInferRequest]
    cancel: CancelPlan | None = None
    stop: asyncio.Event | None = None  # set: the client cancels the stream
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    unattributed_errors: list[str] = field(default_factory=list)


def _text_of(response: service_pb2.ModelInferResponse) -> str | None:
    for index, output in enumerate(response.outputs):
        if output.name == "text_output":
            values = deserialize_bytes_tensor(response.raw_output_contents[index])
            return "".join(v.decode("utf-8", errors="replace") for v in values)
    return None


class SoakClient:
    """One gRPC channel; `run` drives any number of StreamJobs concurrently."""

    def __init__(self, url: str) -> None:
        self._channel = grpc.aio.insecure_channel(url, options=_CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def run(self, job: StreamJob, timeout: float = 600.0) -> StreamJob:
        job.outcomes = {m.id: Outcome(m.id) for m in job.messages}
        pending = set(job.outcomes)
        answered = asyncio.Event()

        async def requests():
            for message in job.messages:
                job.outcomes[message.id].sent_at = time.perf_counter()
                yield message
            # Half-closing early would be legal, but holding the stream open until every
            # answer arrived is what tritonclient's streams do, so the server sees the same.
            await answered.wait()

        call = self._stub.ModelStreamInfer(requests())
        cancel_task = asyncio.create_task(self._cancel_when(job, call))
        deadline = time.perf_counter() + timeout
        received = 0
        try:
            while pending:
                response = await asyncio.wait_for(call.read(), max(0.0, deadline - time.perf_counter()))
                if response is grpc.aio.EOF:
                    break
                now = time.perf_counter()
                received += 1
                self._record(job, pending, response, now)
                plan = job.cancel
                if plan is not None and plan.after_responses and received >= plan.after_responses:
                    call.cancel()
                    break
        except asyncio.CancelledError:
            if not call.cancelled():
                raise  # the caller's task was cancelled, not the stream
        except grpc.aio.AioRpcError as exc:
            if not call.cancelled():  # the server ended the stream: its requests failed
                now = time.perf_counter()
                for request_id in pending:
                    outcome = job.outcomes[request_id]
                    outcome.error = f"stream ended: {exc.code()} {exc.details()}"
                    outcome.error_at = now
        except asyncio.TimeoutError:
            call.cancel()
            now = time.perf_counter()
            for request_id in pending:
                job.outcomes[request_id].error = f"no final response in {timeout:.0f} s"
                job.outcomes[request_id].error_at = now
        finally:
            cancel_task.cancel()
            answered.set()
        if call.cancelled():
            for request_id in pending:
                job.outcomes[request_id].cancelled = True
        else:
            try:
                await asyncio.wait_for(call.code(), 30)
            except asyncio.TimeoutError:
                call.cancel()
        return job

    @staticmethod
    async def _cancel_when(job: StreamJob, call) -> None:
        if job.cancel is not None and job.cancel.after_responses == 0:
            await asyncio.sleep(job.cancel.delay_s)
            call.cancel()
        elif job.stop is not None:
            await job.stop.wait()
            call.cancel()

    @staticmethod
    def _record(job: StreamJob, pending: set[str], response, now: float) -> None:
        infer = response.infer_response
        request_id = infer.id
        if response.error_message:
            # Triton's stream errors carry no request id; one pending request means it is
            # that one, otherwise only the stream can be blamed.
            if not request_id and len(pending) == 1:
                request_id = next(iter(pending))
            if request_id in pending:
                outcome = job.outcomes[request_id]
                outcome.error, outcome.error_at, outcome.final = response.error_message, now, True
                pending.discard(request_id)
            else:
                job.unattributed_errors.append(response.error_message)
            return
        outcome = job.outcomes[request_id]
        text = _text_of(infer)
        if text:
            outcome.pieces.append(text)
            outcome.arrivals.append(now)
        final = infer.parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            outcome.final = True
            pending.discard(request_id)


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000.0) if values else float("nan")
