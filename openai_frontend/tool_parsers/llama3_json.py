"""llama3_json (Llama 3.1 / 3.2 JSON tool calling): the reply is one or more JSON objects
`{"name": ..., "parameters": {...}}` (or "arguments"), separated by `;`, possibly after
<|python_tag|>. Found anywhere in a finished text, as vLLM does; while streaming, a reply
is a call only when it starts with `{` or <|python_tag|> (vLLM's streaming rule)."""
from __future__ import annotations

import json

from openai_frontend.tool_parsers.base import Extracted, Scan, ToolCall, arguments_json, plain
from openai_frontend.tool_parsers.json_calls import ScanCache, ready_calls

PYTHON_TAG = "<|python_tag|>"
_ARG_KEYS = ("parameters", "arguments")


class Llama3JsonParser:
    keeps_special_tokens = False

    def extract(self, text: str) -> Extracted:
        decoder = json.JSONDecoder()
        calls = []
        position = text.find("{")
        try:
            while position >= 0:
                call, end = decoder.raw_decode(text, position)
                if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                    return plain(text)
                arguments = call["arguments"] if "arguments" in call else call["parameters"]
                calls.append(ToolCall(call["name"], arguments_json(arguments)))
                position = text.find("{", end)
        except (ValueError, KeyError, RecursionError):
            return plain(text)
        return Extracted(calls, None) if calls else plain(text)

    def scan(self, text: str, cache: ScanCache) -> Scan:
        lead = len(text) - len(text.lstrip())
        rest = text[lead:]
        if rest.startswith(PYTHON_TAG):
            body = lead + len(PYTHON_TAG)
        elif rest.startswith("{"):
            body = lead
        elif not rest or PYTHON_TAG.startswith(rest):
            return Scan(0)  # not decided yet
        else:
            return Scan(len(text))
        return Scan(0, ready_calls(text, cache.calls(text, body, arg_keys=_ARG_KEYS)))
