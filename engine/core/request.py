"""One sequence's scheduling state (vLLM's v1/request.py)."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, Iterable

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.lora.request import LoRARequest
    from engine.structured_output.grammar import RequestGrammar


class RequestStatus(enum.IntEnum):
    # vLLM's state of a request whose grammar is still compiling: the engine holds it
    # (engine/structured_output/waitlist.py) until it can join the scheduler's WAITING.
    WAITING_FOR_FSM = -1
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence's state. The scheduler is the only writer of its progress and its
    status; `engine/core/stop_checker.py` alone decides when it stops."""

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "priority", "arrival_time",
                 "eos_token_ids", "stop_token_ids", "stop_sequences_by_last", "detokenizer",
                 "cache_salt", "all_token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "num_cached_tokens", "status", "num_preemptions", "stop_reason",
                 "finished_on_stop_token", "first_scheduled_time", "block_hashes", "max_tokens",
                 "grammar", "resumed_at_step", "lora_request", "tenant", "spec_token_ids",
                 "spec_token_probs")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None = None, priority: int = 0,
                 arrival_time: float | None = None,
                 eos_token_id: int | Iterable[int] | None = None,
                 cache_salt: str | None = None, detokenizer: Any = None,
                 lora_request: "LoRARequest | None" = None, tenant: str | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Every id the model ends a turn with (generation_config may list several).
        self.eos_token_ids: tuple[int, ...] = (
            () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int)
            else tuple(eos_token_id))
        params = self.sampling_params
        # Every single id that ends the request (the sampler masks them below min_tokens).
        self.stop_token_ids = frozenset(params.stop_token_ids).union(
            () if params.ignore_eos else self.eos_token_ids)
        # Id sequences by their last id: a new token costs one dict look-up.
        self.stop_sequences_by_last: dict[int, list[tuple[int, ...]]] | None = None
        if params.stop_token_sequences:
            self.stop_sequences_by_last = {}
            for sequence in params.stop_token_sequences:
                self.stop_sequences_by_last.setdefault(sequence[-1], []).append(tuple(sequence))
        # engine.output.detokenizer.IncrementalDetokenizer when the caller wants text and stop
        # strings; None for bare token streams (scheduler tests, warm-up).
        self.detokenizer = detokenizer
        self.cache_salt = cache_salt
        # None: the base model. Part of every block's hash (an adapter's KV is its own).
        self.lora_request = lora_request
        # Whose share it counts against under policy="fair"; None: the tenant "default".
        self.tenant = tenant
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first admission; -1 = not yet looked up
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        # The scheduler step that last readmitted it after a preemption (-1: never).
        self.resumed_at_step = -1
        self.stop_reason: int | str | list[int] | None = None
        # Ended by an EOS or stop_token_ids entry: TensorRT-LLM leaves that id out of its output.
        self.finished_on_stop_token = False
        self.first_scheduled_time: float | None = None  # first admission: ends its queue time
        self.block_hashes: list[int] = []  # hashes of this request's full blocks, chained
        self.max_tokens = self.sampling_params.max_tokens
        # Set by the engine for a structured_outputs request; stop_checker advances it.
        self.grammar: RequestGrammar | None = None
        # Speculative decoding: tokens proposed after all_token_ids, to be verified by the
        # next step that schedules this request (engine/spec_decode/); never part of it.
        self.spec_token_ids: list[int] = []
        # With a draft model's probabilistic drafts: the draft's distribution at each
        # proposed position ([k, vocab], a tensor the runner reads); None: one-hot drafts.
        self.spec_token_probs: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def __lt__(self, other: "Request") -> bool:
        # Heap order for the priority policy: lower value first, then earlier arrival.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
