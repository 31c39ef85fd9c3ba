"""SamplingParams, StructuredOutputsParams and their limits, checked once when built
(vLLM keeps both in vllm/sampling_params.py). Torch-free.

Limits (`check_stop_limits` raises ValueError naming the field; the backend answers
INVALID_ARG). Figures measured on the 2-core AVX2 AMD EPYC dev host, CPython 3.11:
- MAX_STOP_STRINGS = 256: OpenAI's API takes up to 4 stop strings; 256 leaves room for
  generated word lists while bounding what one request holds.
- MAX_STOP_STRING_CHARS = 1,024 per string: a stop string is a marker or a few lines, and a
  stream may hold back up to this many characters minus one while they could begin a match.
- MAX_STOP_CHARS_TOTAL = 16,384 over all strings: building the automaton runs in Python on
  the engine thread once per request (a repeated stop list reuses a cached automaton), at
  ~1.2 us per character: 16-20 ms at this limit (up to ~45 ms with the host busy), a pause
  every stream shares; 200 x 1,000 chars took 0.23-0.5 s. 16,384 still fits 256 strings of
  64 characters or 16 of 1,024.
- MAX_STOP_TOKEN_IDS = 256: the stop checker tests each sampled token against this set
  and the sampler masks all of them while min_tokens is unmet.
- MAX_STOP_TOKEN_SEQUENCES = 256 id sequences of at most MAX_STOP_SEQUENCE_IDS = 256 ids,
  MAX_STOP_SEQUENCE_IDS_TOTAL = 4,096 ids in all (the token path's stop words): a new
  token is compared with the sequences ending in it, at worst every id of every one.

Over 300 lines: SamplingParams and StructuredOutputsParams with their limits in one
module, as vLLM keeps them; each limit's figure is documented where it is checked.
"""
from __future__ import annotations

import enum
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# torch.Generator.manual_seed's range (negative seeds wrap around); larger ints overflow it.
SEED_MIN = -(2 ** 63)
SEED_MAX = 2 ** 64 - 1

# Each of n sequences is a request of its own (a running slot, its own KV tail); the
# cap keeps one client from filling a quarter of the default max_num_seqs (64) alone.
MAX_N = 16

MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_CHARS_TOTAL = 16384
MAX_STOP_TOKEN_IDS = 256
MAX_STOP_TOKEN_SEQUENCES = 256
MAX_STOP_SEQUENCE_IDS = 256
MAX_STOP_SEQUENCE_IDS_TOTAL = 4096


def check_stop_limits(stop: Sequence[str], stop_token_ids: Sequence[int],
                      stop_token_sequences: Sequence[Sequence[int]] = ()) -> None:
    """Raises ValueError naming the field when a request's stop lists exceed the limits."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"SamplingParams.stop has {len(stop)} strings; at most "
                         f"{MAX_STOP_STRINGS} are allowed")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(f"SamplingParams.stop has a string of {longest} characters; at most "
                         f"{MAX_STOP_STRING_CHARS} are allowed")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_CHARS_TOTAL:
        raise ValueError(f"SamplingParams.stop has {total} characters in all; at most "
                         f"{MAX_STOP_CHARS_TOTAL} are allowed")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"SamplingParams.stop_token_ids has {len(stop_token_ids)} ids; at most "
                         f"{MAX_STOP_TOKEN_IDS} are allowed")
    sequences = stop_token_sequences
    if len(sequences) > MAX_STOP_TOKEN_SEQUENCES:
        raise ValueError(f"SamplingParams.stop_token_sequences has {len(sequences)} sequences; "
                         f"at most {MAX_STOP_TOKEN_SEQUENCES} are allowed")
    if any(len(q) > MAX_STOP_SEQUENCE_IDS for q in sequences):
        raise ValueError(f"SamplingParams.stop_token_sequences has a sequence over "
                         f"{MAX_STOP_SEQUENCE_IDS} ids")
    if sum(len(q) for q in sequences) > MAX_STOP_SEQUENCE_IDS_TOTAL:
        raise ValueError(f"SamplingParams.stop_token_sequences has over "
                         f"{MAX_STOP_SEQUENCE_IDS_TOTAL} ids in all")


class RequestOutputKind(enum.Enum):
    """What the engine hands out for a request, and when (vLLM's names and values;
    engine/output/output_processor.py applies it)."""
    # An output whenever something is released: the whole output so far, plus what is
    # new since the previous output in the delta_* fields.
    CUMULATIVE = 0
    # The same moments, carrying only what is new (text, token_ids and logprobs too).
    DELTA = 1
    # One output, once the request has finished; nothing is built before.
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 16
    # Parallel sampling: n sequences for one prompt (engine/output/parallel_sampling.py).
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
    # vLLM's: logprobs of the prompt's own tokens (each position from the one before it),
    # plus the top k there; 0 = the prompt token's only. Computed from the prefill's
    # logits, so such a request reads no prefix-cache hits (engine/core/kv_cache/manager.py).
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    # Output held to a JSON schema / regex / choice / EBNF grammar / any JSON (a dict is
    # read as vLLM's StructuredOutputsParams); compiled when the request is added.
    structured_outputs: StructuredOutputsParams | None = None
    # Set by the caller, not by clients: the backend streams with DELTA and answers
    # non-streaming requests with FINAL_ONLY; LLM.generate asks for FINAL_ONLY.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

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
        # vLLM's -1 (the whole vocabulary at every prompt position) is refused rather than
        # mapped: its result is prompt length x vocabulary entries.
        _check(self.prompt_logprobs is None
               or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
               "prompt_logprobs", "must be a non-negative integer (-1, the whole vocabulary, "
               "is not supported)", self.prompt_logprobs)
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
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind",
               "must be a RequestOutputKind", self.output_kind)

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


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's per-request backend names that mean xgrammar (vllm_backend accepts these too).
_XGRAMMAR_BACKENDS = (None, "auto", "xgrammar", "xgrammar:no-fallback", "xgrammar:_auto")
# vLLM keeps its chosen backend in these; clients that serialise the whole dataclass
# (Triton's OpenAI frontend does) send them back.
_VLLM_INTERNAL = frozenset({"backend_was_auto", "_backend", "_backend_was_auto"})


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams (and the older GuidedDecodingParams): exactly one of
    json (a schema, dict or JSON text), regex, choice, grammar (EBNF) or json_object."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # Accepted for vLLM clients; they change nothing here (xgrammar has no fallback, and
    # its strict mode already refuses properties a schema does not name).
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    backend: str | None = None

    def __post_init__(self) -> None:
        _require(self.json_object is None or isinstance(self.json_object, bool), "json_object",
                 "must be a boolean")
        if self.json_object is False:
            self.json_object = None
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(CONSTRAINT_KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        _require(self.json is None or isinstance(self.json, (dict, str)), "json",
                 "must be a JSON schema (an object or its JSON text)")
        _require(self.regex is None or isinstance(self.regex, str), "regex", "must be a string")
        _require(self.grammar is None or isinstance(self.grammar, str), "grammar",
                 "must be an EBNF grammar string")
        _require(self.choice is None or (isinstance(self.choice, (list, tuple)) and self.choice
                                         and all(isinstance(c, str) for c in self.choice)),
                 "choice", "must be a non-empty list of strings")
        for name in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
            _require(isinstance(getattr(self, name), bool), name, "must be a boolean")
        _require(self.backend in _XGRAMMAR_BACKENDS, "backend",
                 f"must be one of {[b for b in _XGRAMMAR_BACKENDS if b]} (this server uses xgrammar)")
        if self.choice is not None:
            self.choice = list(self.choice)

    @classmethod
    def from_client(cls, key: str, value: Any) -> "StructuredOutputsParams":
        """A client's object, or its JSON text (vllm_backend's clients send text), under
        `key`; unknown keys are errors, null values mean "not set"."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"{key} is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a JSON object, got {type(value).__name__}")
        kwargs = {}
        for name, item in value.items():
            if name in ("whitespace_pattern", "structural_tag"):
                if item is not None:
                    raise ValueError(f"{key}.{name} is not supported")
            elif name in _VLLM_INTERNAL:
                continue
            elif name not in _FIELD_NAMES:
                raise ValueError(f"unknown key {key}.{name}")
            elif item is not None:
                kwargs[name] = item
        try:
            return cls(**kwargs)
        except ValueError as exc:
            raise ValueError(str(exc).replace("structured_outputs", key, 1)) from None

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) is not None)


_FIELD_NAMES = frozenset(StructuredOutputsParams.__dataclass_fields__)


def _require(ok: bool, name: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"structured_outputs.{name} {rule}")
