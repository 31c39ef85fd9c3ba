"""Structured outputs: a request's output held to a JSON schema, a regex, a list of choices,
an EBNF grammar or any JSON, with xgrammar (the library vLLM and TensorRT-LLM use).

One `GrammarCompiler` per engine knows the tokenizer's vocabulary and caches compiled
grammars; one `RequestGrammar` per request follows its output token by token (the stop
checker advances it); the sampler masks only a step's constrained rows
(engine/structured_output/bitmask.py), so unconstrained requests pay nothing. Torch-free, since
engine.core.request imports it; xgrammar is imported on first use: the engine runs without
it, and a constrained request is then a ValueError."""
from __future__ import annotations

import json
import os
import re
import threading
from typing import Any

from engine.sampling_params import StructuredOutputsParams

# As vLLM's default: a server must not grow without bound on clients' distinct schemas.
CACHE_LIMIT_BYTES = 512 << 20
# Whitespace between JSON elements is free, as in vLLM, but a run is capped: a model that
# falls into emitting whitespace (random weights here; vLLM added disable_any_whitespace
# for real ones that did) would otherwise spend max_tokens on it. 32 still fits
# pretty-printed JSON seven levels deep at 4-space indents.
MAX_WHITESPACE_RUN = 32
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def choice_grammar(choices: list[str]) -> str:
    # JSON's string escapes are also xgrammar's EBNF literal escapes (checked for quotes,
    # backslashes, control characters and non-ASCII text).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class RequestGrammar:
    """One request's position in its grammar. Advanced only for tokens appended to the
    output, so a preemption (outputs kept) keeps it and a failed sampling step never
    touched it."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    @classmethod
    def start(cls, compiled: Any) -> "RequestGrammar":
        """At the grammar's beginning; `compiled` comes from GrammarCompiler.compile."""
        return cls(import_xgrammar().GrammarMatcher(compiled))

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token (the model's EOS) was accepted."""
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles constraints for one tokenizer, cached per (kind, spec) by xgrammar. Safe to
    call from Triton's execute thread while the engine thread runs: the backend compiles
    there first, so the engine thread's compile at add_request is a cache hit."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        # The model's vocab may exceed the tokenizer's (padding rows); xgrammar then never
        # allows the ids past the tokenizer's.
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None

    def compile(self, params: StructuredOutputsParams) -> Any:
        """xgrammar's CompiledGrammar; ValueError naming the field when the spec is invalid."""
        compiler = self._xgrammar_compiler()
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                # json_object is OpenAI's "any JSON object", as vLLM compiles it.
                schema = ('{"type": "object"}' if kind == "json_object"
                          else params.json if isinstance(params.json, str) else json.dumps(params.json))
                return compiler.compile_json_schema(
                    schema, any_whitespace=not params.disable_any_whitespace,
                    max_whitespace_cnt=MAX_WHITESPACE_RUN)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _XGRAMMAR_LOCATION.sub("", str(exc).strip())
            raise ValueError(f"structured_outputs.{kind} is invalid: {message}") from None

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgrammar = import_xgrammar()
                # ~0.3 s for a 49k vocabulary: paid by the first constrained request only.
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=_compile_threads(), cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured outputs need the xgrammar package "
                         "(pip install xgrammar)") from None
    return xgrammar


def _compile_threads() -> int:
    # xgrammar's default is 8; fewer where the process may use fewer CPUs. A compile is
    # rare (once per distinct spec), so it may briefly share them with the model.
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))
