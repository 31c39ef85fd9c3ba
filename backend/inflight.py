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
    # RequestOutput -> the response's tensors (the engine decides which outputs come; a
    # stand-in may return None: nothing to send unless the output is the final one).
    build: Callable[[RequestOutput], dict[str, np.ndarray] | None]
    arrival: float
    priority: int = 0  # lower is served first under policy=priority
    ttft_recorded: bool = False


def record_timings(request: Inflight, out: RequestOutput, step: StepMetrics, now: float) -> None:
    """Adds this output's TTFT / inter-token / queue / end-to-end figures to the step's
    metrics. Token times are the engine's (RequestMetrics, stamped at every step that
    sampled for the request), so a FINAL_ONLY request or one streamed with
    stream_interval > 1 reports the same figures as a per-token stream; a stand-in
    engine that does not stamp them yields end-to-end figures only."""
    metrics = out.metrics
    if metrics is not None:
        if not request.ttft_recorded and metrics.first_token_time is not None:
            request.ttft_recorded = True
            # Both on time.monotonic(): the engine got Triton's arrival in add_request.
            step.ttft.append(max(0.0, metrics.first_token_time - request.arrival))
            if metrics.time_in_queue is not None:
                step.queue.append(metrics.time_in_queue)
        step.itl.extend(metrics.inter_token_latencies)
    if out.finished:
        step.e2e.append(now - request.arrival)
