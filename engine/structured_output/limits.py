"""Bounds on a structured-output spec, checked on its text before xgrammar sees it.

xgrammar's compile cannot be stopped once started (see GrammarCompiler), and its cost
grows faster than the input: measured here with SmolLM2's 49k vocabulary on 2 cores, a
schema nested 100 objects deep took 1.3 s just to convert to a grammar and one 700 deep
65.7 s to compile; 4,000 required string properties (280 KB) 11 s and 7,000 (490 KB)
49 s; a `choice` list of 2,000 strings 0.14 s and of 20,000 27.8 s. So each input is
capped by size, and the defaults sit where the worst case measured stays near a second
(64 KiB of schema: 0.2-1.1 s; 32 nested objects: 0.08 s) while every schema in the
OpenAI and vLLM structured-output docs (OpenAI's own cap is 10 levels of nesting, 1,000
enum values) and in our tests passes with room to spare. A spec over a limit is a
ValueError naming the field, its size and the limit (INVALID_ARG, 400 over HTTP)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import StructuredOutputsParams


@dataclass(frozen=True, slots=True)
class StructuredOutputLimits:
    # A JSON schema's size as JSON text, in UTF-8 bytes.
    max_json_schema_bytes: int = 64 << 10
    # Nesting of the schema document's objects and arrays: {"type": "object",
    # "properties": {"a": {...}}} is 2 levels per nested object, so 64 admits 31 nested
    # objects (OpenAI allows 10).
    max_json_schema_depth: int = 64
    # `choice`: how many strings, and their UTF-8 bytes together.
    max_choices: int = 1024
    max_choice_bytes: int = 64 << 10
    # `regex` (and every `pattern` of a JSON schema): its length, and the largest count
    # of a {n} / {n,} / {n,m} repetition.
    max_regex_bytes: int = 16 << 10
    max_regex_repeat: int = 1024
    # `grammar` (EBNF), in UTF-8 bytes.
    max_grammar_bytes: int = 64 << 10


DEFAULT_LIMITS = StructuredOutputLimits()
# {n}, {n,} or {n,m} at a regex position (anything else after "{" is a literal brace).
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def check_limits(params: StructuredOutputsParams, limits: StructuredOutputLimits) -> str | None:
    """ValueError when the spec is over a limit. Returns a JSON schema's text (the form
    xgrammar takes), None for the other kinds. Linear in the spec's size and never
    recursive, so a hostile spec costs no more to refuse than to read."""
    kind = params.kind
    if kind == "json":
        return _check_json_schema(params.json, limits)
    if kind == "regex":
        check_regex("structured_outputs.regex", params.regex, limits)
    elif kind == "choice":
        _check_at_most("structured_outputs.choice", len(params.choice), "strings",
                       limits.max_choices, "max_choices")
        _check_at_most("structured_outputs.choice", sum(_utf8_len(c) for c in params.choice),
                       "bytes", limits.max_choice_bytes, "max_choice_bytes")
    elif kind == "grammar":
        _check_at_most("structured_outputs.grammar", _utf8_len(params.grammar), "bytes",
                       limits.max_grammar_bytes, "max_grammar_bytes")
    return None


def check_regex(field: str, regex: str, limits: StructuredOutputLimits) -> None:
    _check_at_most(field, _utf8_len(regex), "bytes", limits.max_regex_bytes, "max_regex_bytes")
    largest = _largest_repeat(regex)
    if largest > limits.max_regex_repeat:
        raise ValueError(f"{field} repeats {largest} times, over the limit of "
                         f"{limits.max_regex_repeat} (max_regex_repeat)")


def _check_json_schema(schema: dict | str, limits: StructuredOutputLimits) -> str:
    field = "structured_outputs.json"
    if isinstance(schema, str):
        # Measured on the text first: json.loads recurses, a dict's walk below does not.
        _check_at_most(field, _utf8_len(schema), "bytes", limits.max_json_schema_bytes,
                       "max_json_schema_bytes")
        _check_depth(field, _text_depth(schema), limits)
        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"{field} is invalid: not JSON ({exc})") from None
        text = schema
    else:
        _check_depth(field, _object_depth(schema), limits)
        parsed, text = schema, json.dumps(schema)
        _check_at_most(field, _utf8_len(text), "bytes", limits.max_json_schema_bytes,
                       "max_json_schema_bytes")
    for pattern in _patterns(parsed):
        check_regex(f"{field} pattern", pattern, limits)
    return text


def _check_depth(field: str, depth: int, limits: StructuredOutputLimits) -> None:
    if depth > limits.max_json_schema_depth:
        raise ValueError(f"{field} nests {depth} levels deep, over the limit of "
                         f"{limits.max_json_schema_depth} (max_json_schema_depth)")


def _check_at_most(field: str, size: int, unit: str, limit: int, name: str) -> None:
    if size > limit:
        raise ValueError(f"{field} has {size} {unit}, over the limit of {limit} ({name})")


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _text_depth(text: str) -> int:
    """The deepest nesting of [ and { in JSON text, strings skipped."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _object_depth(value: Any) -> int:
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _patterns(schema: Any) -> list[str]:
    """Every string under a "pattern" key of the (depth-checked) schema."""
    found, stack = [], [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            pattern = item.get("pattern")
            if isinstance(pattern, str):
                found.append(pattern)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _largest_repeat(regex: str) -> int:
    """The largest bound of a {n}, {n,} or {n,m} outside character classes and escapes."""
    largest, i, in_class = 0, 0, False
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            if regex[i + 1:i + 2] == "^":
                i += 1
            if regex[i + 1:i + 2] == "]":  # a leading ] is a literal
                i += 1
        elif char == "{" and (match := _REPEAT.match(regex, i)):
            # A count past 9 digits is over any limit (and int() refuses past 4,300).
            largest = max(largest, *(int(n) if len(n) < 10 else 10**9 for n in match.groups() if n))
            i = match.end()
            continue
        i += 1
    return largest
