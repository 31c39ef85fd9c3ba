"""Structured outputs: a request's output held to a JSON schema, a regex, a list of choices,
an EBNF grammar or any JSON, with xgrammar (the library vLLM and TensorRT-LLM use).

One `GrammarCompiler` per engine knows the tokenizer's vocabulary and caches compiled
grammars; one `RequestGrammar` per request follows its output token by token (the stop
checker advances it); the sampler masks only a step's constrained rows
(engine/structured_output/bitmask.py), so unconstrained requests pay nothing. Torch-free, since
engine.core.request imports it; xgrammar is imported on first use: the engine runs without
it, and a constrained request is then a ValueError."""
from __future__ import annotations

import collections
import json
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.sampling_params import StructuredOutputsParams
from engine.structured_output.limits import DEFAULT_LIMITS, StructuredOutputLimits, check_limits

# As vLLM's default (VLLM_XGRAMMAR_CACHE_MB): a server must not grow without bound on
# clients' distinct schemas. xgrammar keeps compiled grammars (4-12 MB each for JSON
# schemas with a 49k vocabulary) under it, dropping the least recently used.
CACHE_LIMIT_BYTES = 512 << 20
# Parsed specs kept for the engine thread's check of what the backend checked (each
# under the limits' 64 KiB of input).
PARSED_CACHE_ENTRIES = 64
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

    def accepted_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the grammar accepts in a row from here, short of the
        stop token that would complete it (no position follows that one: the target's
        own sample there proposes it); the matcher is left where it was (a speculative
        draft is cut there)."""
        matcher = self.matcher
        accepted = count = 0
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                break
            accepted += 1
            if matcher.is_terminated():
                break
            count += 1
        if accepted:
            matcher.rollback(accepted)
        return count

    def fill_after(self, token_ids: list[int], bitmask: Any, row: int) -> None:
        """Row `row` of `bitmask`: the tokens allowed after `token_ids` (which the grammar
        accepts: drafts are cut by accepted_prefix); the matcher is left where it was."""
        matcher = self.matcher
        accepted = 0
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                break
            accepted += 1
        matcher.fill_next_token_bitmask(bitmask, row)
        if accepted:
            matcher.rollback(accepted)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token (the model's EOS) was accepted."""
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Checks and compiles constraints for one tokenizer, in two stages:

    `check` (on the caller's thread: Triton's execute thread, or add_request's) refuses a
    spec over its limits (engine/structured_output/limits.py) or one xgrammar cannot
    parse (a ValueError naming the field), and parses it into an xgrammar Grammar: 10 ms
    for 32 nested objects, 26 ms for 5,000 properties, so cheap once the limits hold.
    Parsed grammars are kept for the next check of the same spec, so the engine thread's
    check of a request the backend checked already costs a look-up.

    `compile_async` builds the token masks (the part that takes seconds) on one
    background thread and returns its Future; xgrammar releases the GIL meanwhile (a
    Python thread kept spinning through a 1.8 s compile here), so the engine keeps
    stepping. Compiled grammars are cached by xgrammar per grammar text, within
    CACHE_LIMIT_BYTES.

    Why a thread and not a killable worker process: a compile in a thread cannot be
    stopped, but a process's result would have to come back, and a CompiledGrammar
    serializes (serialize_json) to 6-7 MB even for a 10-line schema, taking 0.25-0.5 s
    to write and 0.05-0.2 s to read (more than compiling it: 0.03-0.2 s); the child
    would also have to rebuild the tokenizer's info (0.3 s). So the size limits are the
    defence: they bound every compile near a second on this host."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 limits: StructuredOutputLimits = DEFAULT_LIMITS,
                 cache_limit_bytes: int = CACHE_LIMIT_BYTES) -> None:
        self._tokenizer = tokenizer
        # The model's vocab may exceed the tokenizer's (padding rows); xgrammar then never
        # allows the ids past the tokenizer's.
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self.limits = limits
        self._cache_limit_bytes = cache_limit_bytes
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._parsed: collections.OrderedDict[tuple, Any] = collections.OrderedDict()

    def check(self, params: StructuredOutputsParams) -> Any:
        """The spec parsed into an xgrammar Grammar; ValueError naming the field (or the
        limit) when it is over a limit or invalid."""
        key = _spec_key(params)
        # A kept spec passed the limits (which do not change) and parsed: no second look.
        grammar = None if key is None else self._kept(key)
        if grammar is not None:
            return grammar
        schema_text = check_limits(params, self.limits)
        if key is None:
            key = _spec_key(params, schema_text)
            grammar = self._kept(key)
            if grammar is not None:
                return grammar
        grammar = self._parse(params, schema_text)
        with self._lock:
            self._parsed[key] = grammar
            while len(self._parsed) > PARSED_CACHE_ENTRIES:
                self._parsed.popitem(last=False)
        return grammar

    def _kept(self, key: tuple) -> Any:
        with self._lock:
            grammar = self._parsed.get(key)
            if grammar is not None:
                self._parsed.move_to_end(key)
            return grammar

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """Checks now (ValueError as `check`), compiles on the background thread: a
        Future of xgrammar's CompiledGrammar. Cancel it to drop a compile not started."""
        grammar = self.check(params)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            return self._executor.submit(self._compile, grammar)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """Checks and compiles on the calling thread (tests, benches)."""
        return self._compile(self.check(params))

    @property
    def cache_size_bytes(self) -> int:
        """What xgrammar's cache of compiled grammars holds now (0 before the first compile)."""
        with self._lock:
            compiler = self._compiler
        return 0 if compiler is None else compiler.get_cache_size_bytes()

    def close(self) -> None:
        """Drops queued compiles, waits for the running one (bounded by the limits) and
        releases xgrammar's compiler, its cache and its threads while the interpreter is
        whole. A later call starts them again."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._compiler = None
            self._parsed.clear()

    def _parse(self, params: StructuredOutputsParams, schema_text: str | None) -> Any:
        xgrammar = import_xgrammar()
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                # json_object is OpenAI's "any JSON object", as vLLM compiles it.
                return xgrammar.Grammar.from_json_schema(
                    '{"type": "object"}' if kind == "json_object" else schema_text,
                    any_whitespace=not params.disable_any_whitespace,
                    max_whitespace_cnt=MAX_WHITESPACE_RUN)
            if kind == "regex":
                return xgrammar.Grammar.from_regex(params.regex)
            return xgrammar.Grammar.from_ebnf(
                choice_grammar(params.choice) if kind == "choice" else params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _XGRAMMAR_LOCATION.sub("", str(exc).strip())
            raise ValueError(f"structured_outputs.{kind} is invalid: {message}") from None

    def _compile(self, grammar: Any) -> Any:
        return self._xgrammar_compiler().compile_grammar(grammar)

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgrammar = import_xgrammar()
                # ~0.3 s for a 49k vocabulary: paid by the first constrained request only.
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=_compile_threads(), cache_limit_bytes=self._cache_limit_bytes)
            return self._compiler


def _spec_key(params: StructuredOutputsParams, schema_text: str | None = None) -> tuple | None:
    """What identifies a parsed spec. A schema given as an object has none until the
    limits gave its text (json.dumps recurses, so it runs after the depth check)."""
    kind = params.kind
    if kind == "json":
        text = params.json if isinstance(params.json, str) else schema_text
        return None if text is None else (kind, text, params.disable_any_whitespace)
    spec = tuple(params.choice) if kind == "choice" else getattr(params, kind)
    return kind, spec, params.disable_any_whitespace


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
