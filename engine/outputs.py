"""What the engine hands back per request: RequestOutput with one CompletionOutput per
sequence, and the request's timing (vLLM's vllm/outputs.py). Which fields hold the whole
output and which what is new depends on the request's RequestOutputKind
(engine/sampling_params.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's entry at one position (vLLM's vllm/logprobs.py Logprob). rank: 1-based
    among the whole vocabulary's logprobs at that step, as vLLM counts it (the tokens whose
    logprob is >= this one's); the top-k alternatives are ranked 1..k in order."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    # CUMULATIVE and FINAL_ONLY: the output so far; DELTA: what is new, as the delta_* fields.
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per generated token: {token_id: Logprob}, sampled token first.
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    # vLLM's meaning: the stop string, the stop_token_ids entry (None for EOS), or here
    # also the stop_token_sequences entry that ended the output.
    stop_reason: int | str | list[int] | None = None
    # Ended by an EOS / stop_token_ids id, the last of token_ids (TensorRT-LLM drops it).
    finished_on_stop_token: bool = False
    # What is new since the previous output of this request (for streaming): the tokens
    # whose text is released (whole characters, no possible stop-string start), that
    # text, and those tokens' logprobs. A finished output releases everything; FINAL_ONLY's
    # one output holds the whole output here too.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, Logprob]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs (vLLM's layout): one entry per prompt position, None
    # for the first (nothing precedes it), then {token_id: Logprob} with the prompt's own
    # token first (its rank over the vocabulary) and the top k ranked 1..k. In the first
    # output that has them; DELTA: only there; CUMULATIVE: in every output from then on.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # time.monotonic() clock, as Request.arrival_time
    first_scheduled_time: float | None
    # Stamped by the engine at each step that sampled tokens for the request (any of its
    # sequences), whether or not an output went out, so TTFT and inter-token latency
    # (vLLM's) do not depend on the output kind or stream_interval: the step of the first
    # token, and the gaps between such steps since the request's previous output.
    first_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    # The latest step that sampled for it: at the final output, the end of its decode
    # phase (vLLM's last_token_ts).
    last_token_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_in_queue(self) -> float | None:
        """Arrival until first admission (vLLM's request_queue_time_seconds)."""
        if self.first_scheduled_time is None:
            return None
        return max(0.0, self.first_scheduled_time - self.arrival_time)
