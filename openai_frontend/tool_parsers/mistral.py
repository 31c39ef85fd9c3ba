"""mistral (Mistral 7B v0.3, Mistral NeMo, ...): `[TOOL_CALLS]` then a JSON array of
`{"name": ..., "arguments": {...}}`; the text before the marker is content."""
from __future__ import annotations

import json

from openai_frontend.tool_parsers.base import (Extracted, Scan, ToolCall, arguments_json,
                                               held_back, plain)
from openai_frontend.tool_parsers.json_calls import ready_calls, scan_call_objects

MARKER = "[TOOL_CALLS]"


class MistralParser:
    def extract(self, text: str) -> Extracted:
        at = text.find(MARKER)
        if at < 0:
            return plain(text)
        try:
            decoded = json.loads(text[at + len(MARKER):])
            items = decoded if isinstance(decoded, list) else [decoded]
            calls = [ToolCall(_name(item), arguments_json(item["arguments"])) for item in items]
        except (ValueError, KeyError, TypeError):
            return plain(text)
        if not calls:
            return plain(text)
        return Extracted(calls, text[:at].strip() or None)

    def scan(self, text: str) -> Scan:
        at = text.find(MARKER)
        if at < 0:
            return Scan(len(text) - held_back(text, MARKER))
        body = at + len(MARKER)
        while body < len(text) and text[body].isspace():
            body += 1
        in_array = text.startswith("[", body)
        return Scan(at, ready_calls(text, scan_call_objects(text, body, in_array=in_array)))


def _name(item: dict) -> str:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise TypeError("a tool call needs a string name")
    return item["name"]
