"""Request state, sampling parameters and the outputs handed back to callers."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from engine.stop_strings import check_stop_limits
from engine.structured_output import RequestGrammar, StructuredOutputsParams


class RequestStatus(enum.IntEnum):
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


# torch.Generator.manual_seed's range (negative seeds wrap around); larger ints overflow it.
SEED_MIN = -(2 ** 63)
SEED_MAX = 2 ** 64 - 1

# Each of n sequences is a request of its own (a running slot, its own KV tail); the
# cap keeps one client from filling a quarter of the default max_num_seqs (64) alone.
MAX_N = 16

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 16
    # Parallel sampling: n sequences for one prompt (engine/parallel_sampling.py).
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Stop when the output ends with one of these id sequences (TensorRT-LLM's stop_words:
    # matched as ids, no detokenization); the sequence stays in the output.
    stop_token_sequences: list[list[int]] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per token; 0 = sampled only
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    # Output held to a JSON schema / regex / choice / EBNF grammar / any JSON (a dict is
    # read as vLLM's StructuredOutputsParams); compiled when the request is added.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check(self.stop is None or isinstance(self.stop, (str, list, tuple)), "stop",
               "must be a string or a list of strings", self.stop)
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
               "stop_token_ids", "must be a list of integers", self.stop_token_ids)
        _check(self.stop_token_sequences is None or (
            isinstance(self.stop_token_sequences, (list, tuple))
            and all(isinstance(q, (list, tuple)) and q for q in self.stop_token_sequences)),
               "stop_token_sequences", "must be a list of non-empty lists of integers",
               self.stop_token_sequences)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop_token_sequences = [list(q) for q in self.stop_token_sequences or []]
        # -1 means "off" in vLLM for both.
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:
            self.seed = None
        # Floats must be finite: the sampler works in float32, where inf and nan turn
        # whole rows into nan (temperature=inf with a min_tokens mask gave -inf/inf).
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", "must be an integer >= 1", self.max_tokens)
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]",
               self.n)
        _check(_is_finite(self.temperature) and self.temperature >= 0, "temperature",
               "must be a finite number >= 0", self.temperature)
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be -1, 0 or a positive integer",
               self.top_k)
        _check(_is_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]",
               self.top_p)
        _check(_is_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]",
               self.min_p)
        _check(self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
               "seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (-1: none)", self.seed)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings", self.stop)
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers", self.stop_token_ids)
        _check(all(_is_int(t) and t >= 0 for q in self.stop_token_sequences for t in q),
               "stop_token_sequences", "must hold non-negative integers", self.stop_token_sequences)
        check_stop_limits(self.stop, self.stop_token_ids, self.stop_token_sequences)
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0",
               self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens})", self.min_tokens)
        _check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0), "logprobs",
               "must be a non-negative integer", self.logprobs)
        _check(_is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", "must be a finite number > 0", self.repetition_penalty)
        _check(_is_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
               "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        _check(_is_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
               "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, "must be a boolean", getattr(self, name))
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_client(
                "structured_outputs", self.structured_outputs)
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams or a dict",
               self.structured_outputs)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def _check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {rule}, got {_short_repr(value)}")


def _short_repr(value: Any, limit: int = 100) -> str:
    try:
        text = repr(value)
    except ValueError:  # ints past sys.get_int_max_str_digits() refuse repr
        return f"<{type(value).__name__} too large to print>"
    return text if len(text) <= limit else text[:limit] + "..."


class Request:
    """One sequence's state. The scheduler is the only writer of its progress and its
    status; `engine/stop_checker.py` alone decides when it stops."""

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "priority", "arrival_time",
                 "eos_token_ids", "stop_token_ids", "stop_sequences_by_last", "detokenizer",
                 "cache_salt", "all_token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "num_cached_tokens", "status", "num_preemptions", "stop_reason",
                 "finished_on_stop_token", "first_scheduled_time", "block_hashes", "max_tokens",
                 "grammar", "resumed_at_step")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None = None, priority: int = 0,
                 arrival_time: float | None = None,
                 eos_token_id: int | Iterable[int] | None = None,
                 cache_salt: str | None = None, detokenizer: Any = None) -> None:
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
        # engine.detokenizer.IncrementalDetokenizer when the caller wants text and stop
        # strings; None for bare token streams (scheduler tests, warm-up).
        self.detokenizer = detokenizer
        self.cache_salt = cache_salt
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


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per generated token: {token_id: logprob}, sampled token first.
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    # vLLM's meaning: the stop string, the stop_token_ids entry (None for EOS), or here
    # also the stop_token_sequences entry that ended the output.
    stop_reason: int | str | list[int] | None = None
    # Ended by an EOS / stop_token_ids id, the last of token_ids (TensorRT-LLM drops it).
    finished_on_stop_token: bool = False
    # What is new since the previous output of this request (for streaming): the tokens
    # whose text is released (whole characters, no possible stop-string start), that
    # text, and those tokens' logprobs. A finished output releases everything.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, float]] | None = None

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


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # time.monotonic() clock, as Request.arrival_time
    first_scheduled_time: float | None

    @property
    def time_in_queue(self) -> float | None:
        """Arrival until first admission (vLLM's request_queue_time_seconds)."""
        if self.first_scheduled_time is None:
            return None
        return max(0.0, self.first_scheduled_time - self.arrival_time)
