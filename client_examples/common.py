"""Shared pieces of the client programs: prompt formatting, request building, response parsing.

The `llm` model (DESIGN section 4) takes raw text, so chat formatting happens here on the
client side. Everything that does not need a server is a pure function so it can be tested.
"""
from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

# SmolLM2-Instruct's chat template is ChatML.
CHATML_START = "<|im_start|>"
CHATML_END = "<|im_end|>"
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Flags that ask the model for the extra outputs the clients use.
RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")


@dataclass
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str


def format_chatml(messages: Iterable[ChatMessage], add_generation_prompt: bool = True) -> str:
    """Render a conversation as ChatML; the trailing assistant header makes the model answer."""
    parts = [f"{CHATML_START}{m.role}\n{m.content}{CHATML_END}\n" for m in messages]
    if add_generation_prompt:
        parts.append(f"{CHATML_START}assistant\n")
    return "".join(parts)


def clean_assistant_reply(text: str) -> str:
    """Drop an end-of-turn marker if the server did not strip it, so history stays well-formed."""
    end = text.find(CHATML_END)
    if end >= 0:
        text = text[:end]
    return text.strip()


def sampling_parameters(max_tokens: int, temperature: float = 0.0, **extra) -> dict:
    """The sampling_parameters object; None values are left out so server defaults apply."""
    params = {"max_tokens": int(max_tokens), "temperature": float(temperature)}
    params.update({k: v for k, v in extra.items() if v is not None})
    return params


@dataclass
class StreamChunk:
    """One response of a streamed generation, stamped when the client received it."""
    t: float  # time.perf_counter() at receipt
    text: str  # delta since the previous response
    num_output_tokens: Optional[int] = None  # tokens new in this response, when returned
    finish_reason: Optional[str] = None
    final: bool = False


@dataclass
class GenerationRecord:
    """Everything the client observed about one request."""
    send_time: float
    chunks: list[StreamChunk] = field(default_factory=list)
    end_time: Optional[float] = None
    error: Optional[str] = None

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_time is not None


def _first_string(arr: Optional[np.ndarray]) -> Optional[str]:
    if arr is None or arr.size == 0:
        return None
    return "".join(_to_str(x) for x in arr.reshape(-1))


def _to_str(x) -> str:
    return x.decode("utf-8", errors="replace") if isinstance(x, bytes) else str(x)


def chunk_from_arrays(t: float, text, num_output_tokens, finish_reason, final: bool) -> StreamChunk:
    """Build a chunk from the numpy outputs of one response (any of them may be missing)."""
    n_out = None
    if num_output_tokens is not None and num_output_tokens.size > 0:
        n_out = int(num_output_tokens.reshape(-1)[0])
    reason = _first_string(finish_reason)
    return StreamChunk(t=t, text=_first_string(text) or "", num_output_tokens=n_out,
                       finish_reason=reason or None, final=final)


def build_grpc_inputs(prompt: str, sampling: dict, stream: bool = True,
                      exclude_input_in_output: bool = True, return_flags: Iterable[str] = RETURN_FLAGS):
    """InferInput list for the `llm` model."""
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype, triton_type):
        t = grpcclient.InferInput(name, [1], triton_type)
        t.set_data_from_numpy(np.array([value], dtype=dtype))
        return t

    inputs = [
        tensor("text_input", prompt.encode("utf-8"), np.object_, "BYTES"),
        tensor("stream", stream, bool, "BOOL"),
        tensor("sampling_parameters", json.dumps(sampling).encode("utf-8"), np.object_, "BYTES"),
        tensor("exclude_input_in_output", exclude_input_in_output, bool, "BOOL"),
    ]
    inputs += [tensor(flag, True, bool, "BOOL") for flag in return_flags]
    return inputs


def chunk_from_grpc_result(t: float, result) -> StreamChunk:
    response = result.get_response()
    # Present because requests are sent with enable_empty_final_response=True.
    final_param = response.parameters.get("triton_final_response")
    final = bool(final_param.bool_param) if final_param is not None else False
    names = {o.name for o in response.outputs}

    def out(name):
        return result.as_numpy(name) if name in names else None

    return chunk_from_arrays(t, out("text_output"), out("num_output_tokens"), out("finish_reason"), final)


class GrpcStreamSession:
    """One gRPC bidirectional stream carrying one request at a time.

    The callback runs on the stream's reader thread and only timestamps and queues, so the
    receive times are not skewed by whatever the caller does with the text.
    """

    def __init__(self, url: str, model: str):
        import tritonclient.grpc as grpcclient

        self.url, self.model = url, model
        self._client = grpcclient.InferenceServerClient(url=url)
        self._responses: queue.Queue = queue.Queue()
        self._next_id = 0
        self._client.start_stream(callback=self._on_response)

    def _on_response(self, result, error):
        self._responses.put((time.perf_counter(), result, error))

    def _restart_stream(self):
        # After an error or timeout, a stale response could still arrive for the old request
        # without an id to filter on; a fresh stream rules that out.
        self._client.stop_stream(cancel_requests=True)
        self._responses = queue.Queue()
        self._client.start_stream(callback=self._on_response)

    def generate(self, prompt: str, sampling: dict, on_chunk: Optional[Callable[[StreamChunk], None]] = None,
                 timeout_s: float = 600.0) -> GenerationRecord:
        self._next_id += 1
        request_id = str(self._next_id)
        inputs = build_grpc_inputs(prompt, sampling, stream=True)
        record = GenerationRecord(send_time=time.perf_counter())
        self._client.async_stream_infer(self.model, inputs, request_id=request_id,
                                        enable_empty_final_response=True)
        deadline = record.send_time + timeout_s
        while True:
            try:
                t, result, error = self._responses.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                record.error = f"timed out after {timeout_s:.0f}s"
                self._restart_stream()
                return record
            if error is not None:
                record.error = str(error)
                self._restart_stream()
                return record
            if result.get_response().id != request_id:
                continue  # left over from an earlier request on this stream
            chunk = chunk_from_grpc_result(t, result)
            record.chunks.append(chunk)
            if on_chunk is not None and chunk.text:
                on_chunk(chunk)
            if chunk.final:
                record.end_time = t
                return record

    def close(self):
        self._client.stop_stream()
        self._client.close()


def iter_sse_data(lines: Iterable) -> Iterator[dict]:
    """Decode a Server-Sent Events stream into the JSON objects of its `data:` fields.

    An event ends at a blank line; several data lines in one event are joined with newlines
    (SSE rules). Triton sends one `data: {json}` line per response.
    """
    data_lines: list[str] = []
    for raw in lines:
        line = _to_str(raw).rstrip("\r\n")
        if line == "":
            if data_lines:
                yield json.loads("\n".join(data_lines))
                data_lines = []
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            data_lines.append(value[1:] if value.startswith(" ") else value)
    if data_lines:
        yield json.loads("\n".join(data_lines))


def generate_request_body(prompt: str, sampling: dict, stream: bool, exclude_input_in_output: bool = True,
                          return_flags: Iterable[str] = RETURN_FLAGS) -> dict:
    """Body for Triton's /generate and /generate_stream.

    Top-level fields become model inputs; sampling goes in `parameters`, which the model reads
    when no sampling_parameters input is given (DESIGN section 4).
    """
    body = {"text_input": prompt, "stream": stream, "exclude_input_in_output": exclude_input_in_output,
            "parameters": dict(sampling)}
    body.update({flag: True for flag in return_flags})
    return body
