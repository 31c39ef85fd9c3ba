"""A prefix-stable scan of JSON call objects (`{"name": ..., "arguments": {...}}`) in a
text that may stop anywhere: where each object's name and arguments value lie.

Shared by the parsers whose calls are JSON objects (hermes, llama3_json, mistral) and by
tool_choice="required" (an array of {"name", "parameters"}). One pass that knows strings
and nesting, and reads only the keys of the call objects themselves, so braces or quotes
inside the arguments never confuse it. The offsets it finds for a prefix of a text are
the same it finds for the whole text, so streaming can send what grew since last time.

The scanners resume where they stopped (ScanCache keeps one per stream), so a streamed
reply costs one pass over its text, not one per token: a model that writes thousands of
tokens of unfinished JSON must not stall the event loop."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from openai_frontend.tool_parsers.base import ToolCall

# What the scan waits for inside a call object.
_KEY, _COLON, _VALUE, _STRING, _CONTAINER, _SCALAR, _AFTER = range(7)


@dataclass(slots=True)
class CallSpan:
    name: str | None = None
    args_start: int | None = None
    # None while the arguments value is still being written.
    args_end: int | None = None


class CallObjectScanner:
    """The call objects from `start` on: one JSON array of them (in_array) or a sequence
    of objects separated by whitespace, `,` or `;`. Scanning ends for good at anything
    else outside the objects (or at the array's end)."""

    def __init__(self, start: int, arg_keys: tuple[str, ...] = ("arguments",),
                 in_array: bool = False) -> None:
        self.position = start
        self.arg_keys = arg_keys
        self.level = 1 if in_array else 0   # the depth at which a call object opens
        self.spans: list[CallSpan] = []
        self.done = False
        self._depth, self._in_string, self._escaped, self._string_start = 0, False, False, 0
        self._current: CallSpan | None = None
        self._expect, self._key, self._value_start = _KEY, None, 0

    def advance(self, text: str, stop: int | None = None) -> list[CallSpan]:
        stop = len(text) if stop is None else stop
        while not self.done and self.position < stop:
            self._step(text, self.position)
            self.position += 1
        return self.spans

    def _end_value(self, text: str, pos: int) -> None:
        if self._key in self.arg_keys:
            self._current.args_end = pos
        elif self._key == "name" and self._expect == _STRING:
            try:
                self._current.name = json.loads(text[self._value_start:pos])
            except ValueError:
                self._current.name = None
        self._expect = _AFTER

    def _start_value(self, pos: int, state: int) -> None:
        self._value_start = pos
        if self._key in self.arg_keys:
            self._current.args_start = pos
        self._expect = state

    def _step(self, text: str, i: int) -> None:
        ch, level = text[i], self.level
        inside = self._current is not None and self._depth == level + 1
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if inside and self._expect == _KEY:
                    self._key, self._expect = text[self._string_start + 1:i], _COLON
                elif inside and self._expect == _STRING:
                    self._end_value(text, i + 1)
            return
        if ch == '"':
            if self._depth <= level:
                self.done = True  # a string between the call objects: not a call list
                return
            self._in_string, self._string_start = True, i
            if inside and self._expect == _VALUE:
                self._start_value(i, _STRING)
        elif ch in "{[":
            if self._depth < level and ch != "[" or self._depth == level and ch != "{":
                self.done = True
                return
            if self._depth == level:
                self._current = CallSpan()
                self.spans.append(self._current)
                self._expect, self._key = _KEY, None
            elif inside and self._expect == _VALUE:
                self._start_value(i, _CONTAINER)
            self._depth += 1
        elif ch in "}]":
            if inside and self._expect == _SCALAR:
                self._end_value(text, i)
            self._depth -= 1
            if self._current is not None and self._depth == level + 1 \
                    and self._expect == _CONTAINER:
                self._end_value(text, i + 1)
            elif self._depth == level:
                self._current = None
            if self._depth < level or self._depth < 0:
                self.done = True
        elif inside:
            if ch == ":" and self._expect == _COLON:
                self._expect = _VALUE
            elif ch == ",":
                if self._expect == _SCALAR:
                    self._end_value(text, i)
                self._expect, self._key = _KEY, None
            elif ch.isspace():
                if self._expect == _SCALAR:
                    self._end_value(text, i)
            elif self._expect == _VALUE:
                self._start_value(i, _SCALAR)
        elif self._depth <= level and not (ch.isspace() or ch in ",;" and self._depth == level):
            self.done = True


class ContainerEndScanner:
    """Where the JSON object or array that begins at `start` (after whitespace) ends."""

    def __init__(self, start: int) -> None:
        self.position = start
        self.end: int | None = None
        self.done = False
        self._depth, self._in_string, self._escaped = 0, False, False

    def advance(self, text: str) -> int | None:
        while not self.done and self.position < len(text):
            ch = text[self.position]
            self.position += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end, self.done = self.position, True
            elif self._depth == 0 and not ch.isspace():
                self.done = True  # not an object or array: it never ends as one
        return self.end


@dataclass(slots=True)
class ScanCache:
    """One streamed reply's scanners, by where they start."""
    scanners: dict[tuple, object] = field(default_factory=dict)

    def get(self, key: tuple, make):
        scanner = self.scanners.get(key)
        if scanner is None:
            scanner = self.scanners[key] = make()
        return scanner

    def calls(self, text: str, start: int, stop: int | None = None,
              arg_keys: tuple[str, ...] = ("arguments",), in_array: bool = False) -> list[CallSpan]:
        return self.get(("calls", start, arg_keys, in_array),
                        lambda: CallObjectScanner(start, arg_keys, in_array)).advance(text, stop)

    def container_end(self, text: str, start: int) -> int | None:
        return self.get(("end", start), lambda: ContainerEndScanner(start)).advance(text)


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
