"""What a tool-call parser produces, whole or while the text is still arriving.

A parser has two views of the model's text: `extract` (the finished text -> calls and
the content left over) and `scan` (any prefix of it -> how much is surely plain content,
and the calls already recognisable; called with ever longer texts of one stream). `scan` must be prefix-stable: on a longer text the
content end never moves back and each call's arguments only grow, which is what lets
the streaming layer (openai_frontend/tool_calls.py) send differences and nothing else."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from openai_frontend.tool_parsers.json_calls import ScanCache


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    # A JSON text, as OpenAI sends it.
    arguments: str


@dataclass(frozen=True, slots=True)
class Extracted:
    calls: list[ToolCall]
    # The text that is not a call (None: nothing); all of it when no call was found.
    content: str | None


@dataclass(frozen=True, slots=True)
class Scan:
    # text[:content_end] is content for sure: no call marker can start inside it.
    content_end: int
    # Calls whose name is known, in order; arguments so far (a growing prefix).
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    # The markers are special tokens: the reply must be decoded with them kept.
    keeps_special_tokens: bool

    def extract(self, text: str) -> Extracted: ...

    def scan(self, text: str, cache: ScanCache) -> Scan:
        """`cache`: the stream's own (its scanners resume where they stopped)."""


def plain(text: str) -> Extracted:
    return Extracted([], text)


def arguments_json(value: Any) -> str:
    # As vLLM: the model's arguments re-serialised, non-ASCII kept as it is.
    return json.dumps(value, ensure_ascii=False)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`: they
    are held back from the content until the next characters decide."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def earliest_tag(text: str, start: int, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """The first of `tags` in text[start:] as (position, tag), or None: the streaming
    parsers' (tool calls, reasoning) scan for their markers."""
    best: tuple[int, str] | None = None
    for tag in tags:
        at = text.find(tag, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, tag)
    return best


def partial_tag_length(text: str, tags: tuple[str, ...], start: int = 0) -> int:
    """How many characters at the end of text[start:] could begin one of `tags` (without
    being one): what a stream holds back until the next delta decides."""
    for size in range(min(len(text) - start, max(map(len, tags)) - 1), 0, -1):
        end = text[-size:]
        if any(tag.startswith(end) for tag in tags):
            return size
    return 0
