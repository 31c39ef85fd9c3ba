"""Feeding a text to a ToolStream piece by piece, and putting the deltas back together
the way the openai client's stream accumulator does (per index: id, name, then
arguments appended). Every cut of the text must give the same result."""
from __future__ import annotations

import json

from openai_frontend.tool_calls import ToolPlan, ToolStream


def assemble(plan: ToolPlan, text: str, step: int) -> tuple[str, list[tuple[str, str]], ToolStream]:
    stream = ToolStream(plan)
    content, calls = "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        new_content, deltas = stream.feed(piece)
        if i == len(pieces) - 1:
            new_content += stream.flush()
        content += new_content
        for delta in deltas:
            index = delta["index"]
            if index not in calls:
                assert set(delta) == {"index", "id", "type", "function"}, delta
                assert delta["type"] == "function" and delta["id"].startswith("chatcmpl-tool-")
                assert len(delta["id"]) == len("chatcmpl-tool-") + 16
                calls[index] = [delta["function"]["name"], delta["function"]["arguments"]]
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                calls[index][1] += delta["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)], stream


def check_every_cut(plan: ToolPlan, text: str, content: str, calls: list[tuple[str, dict]]) -> None:
    """Streamed in pieces of every size, `text` gives `content` and `calls` (names and
    decoded arguments)."""
    for step in range(1, len(text) + 1):
        got_content, got_calls, _ = assemble(plan, text, step)
        assert got_content == content, step
        assert [(n, json.loads(a)) for n, a in got_calls] == calls, step
