"""A prefix-stable scan of JSON call objects (`{"name": ..., "arguments": {...}}`) in a
text that may stop anywhere: where each object's name and arguments value lie.

Shared by the parsers whose calls are JSON objects (hermes, llama3_json, mistral) and by
tool_choice="required" (an array of {"name", "parameters"}). One pass that knows strings
and nesting, and reads only the keys of the call objects themselves, so braces or quotes
inside the arguments never confuse it. The offsets it finds for a prefix of a text are
the same it finds for the whole text, so streaming can send what grew since last time."""
from __future__ import annotations

import json
from dataclasses import dataclass

from openai_frontend.tool_parsers.base import ToolCall

# What the scan waits for inside a call object.
_KEY, _COLON, _VALUE, _STRING, _CONTAINER, _SCALAR, _AFTER = range(7)


@dataclass(slots=True)
class CallSpan:
    name: str | None = None
    args_start: int | None = None
    # None while the arguments value is still being written.
    args_end: int | None = None


def scan_call_objects(text: str, start: int = 0, stop: int | None = None,
                      arg_keys: tuple[str, ...] = ("arguments",),
                      in_array: bool = False) -> list[CallSpan]:
    """The call objects of text[start:stop]: one JSON array of them (in_array) or a
    sequence of objects separated by whitespace, `,` or `;`. Scanning ends at anything
    else outside the objects (or at the array's end)."""
    stop = len(text) if stop is None else stop
    level = 1 if in_array else 0   # the depth at which a call object opens
    spans: list[CallSpan] = []
    depth, in_string, escaped, string_start = 0, False, False, 0
    current: CallSpan | None = None
    expect, key, value_start = _KEY, None, 0

    def end_value(pos: int) -> None:
        nonlocal expect
        if key in arg_keys:
            current.args_end = pos
        elif key == "name" and expect == _STRING:
            try:
                current.name = json.loads(text[value_start:pos])
            except ValueError:
                current.name = None
        expect = _AFTER

    def start_value(pos: int, state: int) -> None:
        nonlocal expect, value_start
        value_start = pos
        if key in arg_keys:
            current.args_start = pos
        expect = state

    for i in range(start, stop):
        ch = text[i]
        inside = current is not None and depth == level + 1
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if inside and expect == _KEY:
                    key, expect = text[string_start + 1:i], _COLON
                elif inside and expect == _STRING:
                    end_value(i + 1)
            continue
        if ch == '"':
            if depth <= level:
                break  # a string between the call objects: not a call list
            in_string, string_start = True, i
            if inside and expect == _VALUE:
                start_value(i, _STRING)
        elif ch in "{[":
            if depth < level and ch != "[" or depth == level and ch != "{":
                break
            if depth == level:
                current = CallSpan()
                spans.append(current)
                expect, key = _KEY, None
            elif inside and expect == _VALUE:
                start_value(i, _CONTAINER)
            depth += 1
        elif ch in "}]":
            if inside and expect == _SCALAR:
                end_value(i)
            depth -= 1
            if current is not None and depth == level + 1 and expect == _CONTAINER:
                end_value(i + 1)
            elif depth == level:
                current = None
            if depth < level or depth < 0:
                break
        elif inside:
            if ch == ":" and expect == _COLON:
                expect = _VALUE
            elif ch == ",":
                if expect == _SCALAR:
                    end_value(i)
                expect, key = _KEY, None
            elif ch.isspace():
                if expect == _SCALAR:
                    end_value(i)
            elif expect == _VALUE:
                start_value(i, _SCALAR)
        elif depth <= level and not (ch.isspace() or ch in ",;" and depth == level):
            break
    return spans


def ready_calls(text: str, spans: list[CallSpan], stop: int | None = None) -> list[ToolCall]:
    """The leading calls whose name is known and whose arguments have begun, with their
    arguments text so far. Calls come in order, so the first one not ready ends the list."""
    stop = len(text) if stop is None else stop
    calls = []
    for span in spans:
        if span.name is None or span.args_start is None:
            break
        end = span.args_end if span.args_end is not None else stop
        calls.append(ToolCall(span.name, text[span.args_start:end]))
    return calls


def json_container_end(text: str, start: int, stop: int | None = None) -> int | None:
    """Just past the JSON object or array that begins at text[start] (after whitespace);
    None while it is still open (or when no object or array begins there)."""
    stop = len(text) if stop is None else stop
    depth, in_string, escaped = 0, False, False
    for i in range(start, stop):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and not ch.isspace():
            return None
    return None
