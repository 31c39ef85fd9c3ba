"""A prompt and its parameters -> checked sequences the engine can queue (vLLM's
InputProcessor): every check that can refuse a request runs here, before anything is
built, so LLMEngine.add_request only hands the result to the scheduler (or, while its
grammar compiles, to the waitlist) and to the output processor."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from engine.config.generation import SamplingDefaults
from engine.core.fair_share import check_tenant
from engine.core.request import Request
from engine.lora.request import LoRARequest
from engine.output.detokenizer import IncrementalDetokenizer
from engine.output.parallel_sampling import fan_out
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ProcessedRequest:
    request_id: str
    prompt_text: str | None  # None when the prompt came as token ids
    token_ids: list[int]
    params: SamplingParams
    sequences: list[Request]  # one per `n`, in order
    grammar: Future | None  # the structured-output compile the sequences wait for


class InputProcessor:
    """`is_taken(request_id)`: whether an id is in use (the output processor knows);
    `check_admissible(request_id, num_prompt_tokens)`: the scheduler's own admission
    checks (the id's form, the prompt against max_model_len and the pool);
    `sampling_defaults`: what a request added without SamplingParams samples with (the
    model's generation_config, engine/config/generation.py)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_model_len: int, max_logprobs: int, lora: Any, grammar_compiler: Any,
                 is_taken: Callable[[str], bool],
                 check_admissible: Callable[[str, int], None],
                 sampling_defaults: SamplingDefaults | None = None) -> None:
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._eos = eos_token_ids
        self._max_model_len = max_model_len
        self._max_logprobs = max_logprobs
        self._lora = lora  # None unless enable_lora
        self._grammars = grammar_compiler
        self._is_taken = is_taken
        self._check_admissible = check_admissible
        self._sampling_defaults = sampling_defaults or SamplingDefaults()

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                priority: int = 0, arrival_time: float | None = None,
                cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                tenant: str | None = None) -> ProcessedRequest:
        """Raises ValueError naming what is wrong; nothing is kept then."""
        params = params or self._sampling_defaults.sampling_params()
        check_tenant(tenant)
        sequences = fan_out(request_id, params)
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids = self._tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        # The ids and the length first: a huge id list is refused before it is scanned
        # (on the engine thread). The parent id of n > 1 sequences is taken too.
        for rid in {request_id, *(rid for rid, _ in sequences)}:
            if self._is_taken(rid):
                raise ValueError(f"request id {rid!r} is already in use")
            self._check_admissible(rid, len(token_ids))
        self._check_vocabulary(token_ids, params)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self._max_logprobs:
                raise ValueError(f"SamplingParams.{name} must be <= max_logprobs "
                                 f"({self._max_logprobs}), got {asked}")
        if lora_request is not None:
            if self._lora is None:
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested, but the "
                                 "engine was started without enable_lora")
            self._lora.adapter(lora_request)  # loads it now: a bad adapter fails here, alone
        # Last of the checks, so an invalid request starts no compile (a spec over a limit
        # or invalid raises here; a look-up when the backend checked it already). The
        # compile itself runs on the compiler's thread.
        grammar = (None if params.structured_outputs is None
                   else self._grammars.compile_async(params.structured_outputs))
        requests = []
        for rid, seq_params in sequences:
            request = Request(rid, token_ids, seq_params, priority=priority,
                              arrival_time=arrival_time, eos_token_id=self._eos,
                              cache_salt=cache_salt, detokenizer=IncrementalDetokenizer(
                                  self._tokenizer, token_ids, seq_params),
                              lora_request=lora_request, tenant=tenant)
            if params.max_tokens is None:
                request.max_tokens = self._max_model_len - len(token_ids)
            requests.append(request)
        return ProcessedRequest(request_id, prompt_text, token_ids, params, requests, grammar)

    def _check_vocabulary(self, token_ids: list[int], params: SamplingParams) -> None:
        vocab = self._vocab
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {vocab}): {bad[:5]}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be < vocab size {vocab}")
        if any(t >= vocab for q in params.stop_token_sequences for t in q):
            raise ValueError(f"SamplingParams.stop_token_sequences must be < vocab size {vocab}")
