"""llama3_json: {"name", "parameters"} objects, `;`-separated, maybe after <|python_tag|>."""
from __future__ import annotations

import json

from openai_frontend.tool_calls import ToolPlan
from openai_frontend.tool_parsers import make_parser
from tests.openai_frontend.tool_parsers.streamed import check_every_cut

PLAN = ToolPlan("auto", parser=make_parser("llama3_json"))
TWO = ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2.5}}; '
       '{"name": "echo", "arguments": {"s": "x; {y}"}}')


def test_semicolon_separated_calls_after_the_python_tag():
    found = PLAN.parser.extract(TWO)
    assert found.content is None
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [
        ("add", {"a": 1, "b": 2.5}), ("echo", {"s": "x; {y}"})]
    bare = PLAN.parser.extract('{"name": "f", "parameters": {}}')
    assert [(c.name, c.arguments) for c in bare.calls] == [("f", "{}")]


def test_streamed():
    check_every_cut(PLAN, TWO, "", [("add", {"a": 1, "b": 2.5}), ("echo", {"s": "x; {y}"})])
    check_every_cut(PLAN, '  {"parameters": {"k": [1]}, "name": "g"}', "", [("g", {"k": [1]})])


def test_malformed_text_is_plain_content():
    for text in ("The answer is 4.", '{"name": "f"}', '{"parameters": {}}', '{"name": "f", "para',
                 "set {x}"):
        found = PLAN.parser.extract(text)
        assert found.calls == [] and found.content == text
    check_every_cut(PLAN, "The answer is 4.", "The answer is 4.", [])
    check_every_cut(PLAN, "<|python", "<|python", [])
