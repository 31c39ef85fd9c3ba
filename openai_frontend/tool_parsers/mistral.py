"""mistral: `[TOOL_CALLS]` marks the calls; the text before the first marker is content.
Two forms, as Mistral's tokenizers write them: `[TOOL_CALLS]name[ARGS]{...}` once per call
(tokenizer v11 and later; what vLLM 0.32 reads with a Hugging Face tokenizer), and the
older `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, NeMo)."""
from __future__ import annotations

import json

from openai_frontend.tool_parsers.base import (Extracted, Scan, ToolCall, arguments_json,
                                               held_back, plain)
from openai_frontend.tool_parsers.json_calls import ScanCache, ready_calls

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralParser:
    # [TOOL_CALLS] is a control token: decoding must keep it, as vLLM does.
    keeps_special_tokens = True

    def extract(self, text: str) -> Extracted:
        at = text.find(MARKER)
        if at < 0:
            return plain(text)
        calls = []
        try:
            for segment in text[at + len(MARKER):].split(MARKER):
                if segment.lstrip().startswith(("[", "{")):
                    decoded = json.loads(segment)
                    items = decoded if isinstance(decoded, list) else [decoded]
                    calls.extend(ToolCall(_name(i), arguments_json(i["arguments"])) for i in items)
                else:
                    name, found, arguments = segment.partition(ARGS)
                    if not found or not name.strip():
                        return plain(text)
                    calls.append(ToolCall(name.strip(), arguments_json(json.loads(arguments))))
        except (ValueError, KeyError, TypeError, RecursionError):
            return plain(text)
        if not calls:
            return plain(text)
        return Extracted(calls, text[:at].strip() or None)

    def scan(self, text: str, cache: ScanCache) -> Scan:
        at = text.find(MARKER)
        if at < 0:
            return Scan(len(text) - held_back(text, MARKER))
        calls: list[ToolCall] = []
        marker = at
        while marker >= 0:
            body = marker + len(MARKER)
            while body < len(text) and text[body].isspace():
                body += 1
            if text.startswith(("[", "{"), body):
                calls.extend(ready_calls(text, cache.calls(
                    text, body, in_array=text.startswith("[", body))))
                break
            args = text.find(ARGS, body)
            if args < 0:
                break  # the name is not finished yet
            start = args + len(ARGS)
            end = cache.container_end(text, start)
            calls.append(ToolCall(text[body:args].strip(), text[start:end or len(text)]))
            if end is None:
                break
            marker = text.find(MARKER, end)
        return Scan(at, calls)


def _name(item: dict) -> str:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise TypeError("a tool call needs a string name")
    return item["name"]
