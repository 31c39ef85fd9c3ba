"""One request on its way through the engine loop, and the figures it yields for vLLM's
request metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from backend.metrics import FinishedRequest, StepMetrics
from engine.api import LoRARequest, PoolingParams, PoolingRequestOutput, RequestOutput, SamplingParams


@dataclass(slots=True)
class Inflight:
    request_id: str
    # A pooling model's prompt may be a cross-encoder's (text, text_pair).
    prompt: str | list[int] | tuple[str, str]
    # PoolingParams on a pooling model (runner="pooling"): one vector, one final output.
    params: SamplingParams | PoolingParams
    sender: Any
    # The engine's output -> the response's tensors (the engine decides which outputs
    # come; a stand-in may return None: nothing to send unless the output is the final one).
    build: Callable[[RequestOutput | PoolingRequestOutput], dict[str, np.ndarray] | None]
    arrival: float
    priority: int = 0  # lower is served first under policy=priority
    lora_request: LoRARequest | None = None  # None: the base model
    tenant: str | None = None  # under policy=fair; None: the tenant "default"
    ttft_recorded: bool = False
    # Tokens generated so far, per sequence (each output's deltas: every output kind
    # carries them, and the engine never sends a token twice).
    num_generated: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        """The sequences it queues: a generation request's n, a pooling request's one."""
        return max(1, self.params.n) if isinstance(self.params, SamplingParams) else 1


def record_timings(request: Inflight, out: RequestOutput | PoolingRequestOutput, step: StepMetrics,
                   now: float) -> None:
    """Adds this output's figures to the step's metrics. Token times are the engine's
    (RequestMetrics, stamped at every step that sampled for the request), so a FINAL_ONLY
    request or one streamed with stream_interval > 1 reports the same figures as a
    per-token stream; a stand-in engine that does not stamp them yields end-to-end and
    token-count figures only."""
    if isinstance(out, PoolingRequestOutput):
        _record_pooled(request, out, step, now)
        return
    counts = request.num_generated
    for completion in out.outputs:
        while len(counts) <= completion.index:
            counts.append(0)
        counts[completion.index] += len(completion.delta_token_ids)
    metrics = out.metrics
    if metrics is not None:
        if not request.ttft_recorded and metrics.first_token_time is not None:
            request.ttft_recorded = True
            # Both on time.monotonic(): the engine got Triton's arrival in add_request.
            step.ttft.append(max(0.0, metrics.first_token_time - request.arrival))
            cached = max(out.num_cached_tokens, 0)
            step.prompt_cached += cached
            step.prompt_computed += max(0, len(out.prompt_token_ids) - cached)
        step.itl.extend(metrics.inter_token_latencies)
    if out.finished:
        _record_finished(request, out, step, now)


def _record_finished(request: Inflight, out: RequestOutput, step: StepMetrics, now: float) -> None:
    """One FinishedRequest per sequence (vLLM finishes each of n's children on its own);
    the n and max-generation figures once per request, as vLLM's parent request does."""
    metrics = out.metrics
    e2e = now - request.arrival
    queued = prefill = decode = inference = 0.0
    if metrics is not None and metrics.first_scheduled_time is not None:
        scheduled = metrics.first_scheduled_time
        queued = max(0.0, scheduled - request.arrival)
        if metrics.first_token_time is not None:
            last = metrics.last_token_time or metrics.first_token_time
            prefill = max(0.0, metrics.first_token_time - scheduled)
            decode = max(0.0, last - metrics.first_token_time)
            inference = max(0.0, last - scheduled)
    counts = request.num_generated
    for completion in out.outputs:
        step.finished.append(FinishedRequest(
            finish_reason=completion.finish_reason or "abort",
            num_prompt_tokens=len(out.prompt_token_ids),
            num_generation_tokens=counts[completion.index],
            num_cached_tokens=out.num_cached_tokens,
            num_preemptions=metrics.num_preemptions if metrics is not None else 0,
            e2e=e2e, queued=queued, prefill=prefill, decode=decode, inference=inference,
            max_tokens_param=request.params.max_tokens))
    step.n_params.append(request.params.n)
    step.max_generation_tokens.append(max(counts, default=0))


def _record_pooled(request: Inflight, out: PoolingRequestOutput, step: StepMetrics,
                   now: float) -> None:
    """A pooling request's one output is its final one: its prompt tokens by where their KV
    came from, and one finished request with no generation tokens (and no token times)."""
    cached = max(out.num_cached_tokens, 0)
    step.prompt_cached += cached
    step.prompt_computed += max(0, len(out.prompt_token_ids) - cached)
    step.finished.append(FinishedRequest(
        finish_reason="stop", num_prompt_tokens=len(out.prompt_token_ids),
        num_generation_tokens=0, num_cached_tokens=cached, e2e=now - request.arrival))
    step.n_params.append(1)
