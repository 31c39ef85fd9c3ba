"""hermes: <tool_call>{json}</tool_call> blocks, whole and streamed."""
from __future__ import annotations

import json

from openai_frontend.tool_calls import ToolPlan
from openai_frontend.tool_parsers import make_parser
from tests.openai_frontend.tool_parsers.streamed import check_every_cut

PLAN = ToolPlan("auto", parser=make_parser("hermes"))
TWO = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
       '"days": [1, {"x": "}]\\""}]}}\n</tool_call>\n<tool_call>{"arguments": {"q": "é"}, '
       '"name": "search"}</tool_call>')


def test_two_calls_after_content():
    found = PLAN.parser.extract(TWO)
    assert found.content == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [
        ("get_weather", {"city": "Paris", "days": [1, {"x": '}]"'}]}), ("search", {"q": "é"})]
    assert found.calls[1].arguments == '{"q": "é"}'  # non-ASCII kept, as vLLM's json.dumps


def test_streamed_in_any_pieces_gives_the_same_calls():
    check_every_cut(PLAN, TWO, "Let me check. ", [
        ("get_weather", {"city": "Paris", "days": [1, {"x": '}]"'}]}), ("search", {"q": "é"})])


def test_unclosed_call_at_the_end_still_counts():
    found = PLAN.parser.extract('<tool_call>{"name": "f", "arguments": {}}')
    assert [(c.name, c.arguments) for c in found.calls] == [("f", "{}")] and found.content is None


def test_malformed_text_is_plain_content():
    for text in ("no calls here", '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>',
                 '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>[1, 2]</tool_call>'):
        found = PLAN.parser.extract(text)
        assert found.calls == [] and found.content == text
    # Streamed: the held-back text comes out as content at the end.
    check_every_cut(PLAN, "a <tool_call> b", "a <tool_call> b", [])
    check_every_cut(PLAN, "plain <tool_ text", "plain <tool_ text", [])
