"""pythonic: [f(a=1), g(b="x")], read with ast, never evaluated."""
from __future__ import annotations

import json

from openai_frontend.tool_calls import ToolPlan
from openai_frontend.tool_parsers import make_parser
from tests.openai_frontend.tool_parsers.streamed import check_every_cut

PLAN = ToolPlan("auto", parser=make_parser("pythonic"))
TWO = '[get_weather(city="Paris, FR", units=\'c\'), add(a=1, b=[2, (3, 4)], c={"k": None}, d=true)]'
CALLS = [("get_weather", {"city": "Paris, FR", "units": "c"}),
         ("add", {"a": 1, "b": [2, [3, 4]], "c": {"k": None}, "d": True})]


def test_list_of_calls():
    found = PLAN.parser.extract(TWO)
    assert found.content is None
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == CALLS


def test_streamed():
    check_every_cut(PLAN, TWO, "", CALLS)
    check_every_cut(PLAN, " [f()]", "", [("f", {})])


def test_malformed_or_unsafe_text_is_plain_content():
    for text in ("Paris is sunny.", "[f(1)]", "[f(a=g())]", "[f(**kw)]", "[1, 2]", "[]",
                 "[f(a=1)", "[__import__('os').system(x='ls')]", "[f(a=1)] trailing"):
        found = PLAN.parser.extract(text)
        assert found.calls == [] and found.content == text, text
    check_every_cut(PLAN, "Paris is sunny.", "Paris is sunny.", [])
    check_every_cut(PLAN, "[f(a=1", "[f(a=1", [])
