"""hermes (Hermes 2 Pro, Qwen 2.5 and others): each call is a JSON object
`{"name": ..., "arguments": {...}}` between <tool_call> and </tool_call>; the text before
the first <tool_call> is the message's content."""
from __future__ import annotations

import json
import re

from openai_frontend.tool_parsers.base import (Extracted, Scan, ToolCall, arguments_json,
                                               held_back, plain)
from openai_frontend.tool_parsers.json_calls import ScanCache, ready_calls

START, END = "<tool_call>", "</tool_call>"
# A call left open at the end (the model stopped before </tool_call>) still counts.
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


class HermesParser:
    # <tool_call> is a special token in some vocabularies (Hermes 2 Pro); vLLM keeps them too.
    keeps_special_tokens = True

    def extract(self, text: str) -> Extracted:
        first = text.find(START)
        if first < 0:
            return plain(text)
        calls = []
        try:
            for block in _BLOCK.findall(text, first):
                if not block.strip():
                    continue
                call = json.loads(block)
                calls.append(ToolCall(_name(call), arguments_json(call["arguments"])))
        except (ValueError, KeyError, TypeError, RecursionError):
            return plain(text)
        if not calls:
            return plain(text)
        return Extracted(calls, text[:first] or None)

    def scan(self, text: str, cache: ScanCache) -> Scan:
        first = text.find(START)
        if first < 0:
            return Scan(len(text) - held_back(text, START))
        calls = []
        position = first
        while position >= 0:
            body = position + len(START)
            end = text.find(END, body)
            stop = len(text) if end < 0 else end
            found = ready_calls(text, cache.calls(text, body, stop), stop)[:1]
            calls.extend(found)
            if end < 0 or not found:
                break
            position = text.find(START, end + len(END))
        return Scan(first, calls)


def _name(call: dict) -> str:
    name = call["name"]
    if not isinstance(name, str):
        raise TypeError("a tool call's name must be a string")
    return name
