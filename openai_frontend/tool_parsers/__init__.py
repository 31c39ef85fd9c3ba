"""Tool-call parsers by vLLM's `--tool-call-parser` names: each turns one model family's
tool-call text into OpenAI tool calls (openai_frontend/tool_calls.py uses them)."""
from __future__ import annotations

from openai_frontend.tool_parsers.base import Extracted, Scan, ToolCall, ToolParser
from openai_frontend.tool_parsers.harmony import OpenAIParser
from openai_frontend.tool_parsers.hermes import HermesParser
from openai_frontend.tool_parsers.llama3_json import Llama3JsonParser
from openai_frontend.tool_parsers.mistral import MistralParser
from openai_frontend.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                            "mistral": MistralParser, "openai": OpenAIParser,
                            "pythonic": PythonicParser}


def make_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; "
                         f"one of {sorted(PARSERS)}") from None


__all__ = ["Extracted", "PARSERS", "Scan", "ToolCall", "ToolParser", "make_parser"]
