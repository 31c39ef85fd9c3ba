"""One request on its way through the engine loop, and the latency figures it yields."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from backend.metrics import StepMetrics
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class Inflight:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sender: Any
    # RequestOutput -> tensors to send, or None when this step has nothing for the client.
    build: Callable[[RequestOutput], dict[str, np.ndarray] | None]
    arrival: float
    priority: int = 0  # lower is served first under policy=priority
    first_token_at: float | None = None
    last_token_at: float | None = None


def record_timings(request: Inflight, out: RequestOutput, step: StepMetrics, step_start: float,
                   now: float) -> None:
    """Adds this output's TTFT / inter-token / queue / end-to-end figures to the step's metrics."""
    new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)  # n > 1: any sequence's
    if new_tokens:
        if request.first_token_at is None:
            request.first_token_at = now
            step.ttft.append(now - request.arrival)
            queued = out.metrics.time_in_queue if out.metrics is not None else None
            # The engine counts from Triton's arrival (passed to add_request) to the
            # request's first admission; a stand-in engine may not say.
            step.queue.append(max(0.0, step_start - request.arrival) if queued is None else queued)
        else:
            step.itl.append(now - request.last_token_at)
        request.last_token_at = now
    if out.finished:
        step.e2e.append(now - request.arrival)
