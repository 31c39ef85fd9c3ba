"""mistral: [TOOL_CALLS] then a JSON array of {"name", "arguments"}."""
from __future__ import annotations

import json

from openai_frontend.tool_calls import ToolPlan
from openai_frontend.tool_parsers import make_parser
from tests.openai_frontend.tool_parsers.streamed import check_every_cut

PLAN = ToolPlan("auto", parser=make_parser("mistral"))
TWO = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "[Paris]"}}, '
       '{"name": "noop", "arguments": {}}]')


def test_array_of_calls():
    found = PLAN.parser.extract(TWO)
    assert found.content is None
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [
        ("get_weather", {"city": "[Paris]"}), ("noop", {})]
    with_text = PLAN.parser.extract('Sure.[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]')
    assert with_text.content == "Sure." and with_text.calls[0].arguments == '{"a": 1}'


def test_name_args_form_of_newer_tokenizers():
    text = 'Sure [TOOL_CALLS]get_weather[ARGS]{"city": "[ARGS]"}[TOOL_CALLS]noop[ARGS]{}'
    found = PLAN.parser.extract(text)
    assert found.content == "Sure"
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [
        ("get_weather", {"city": "[ARGS]"}), ("noop", {})]
    check_every_cut(PLAN, text, "Sure ", [("get_weather", {"city": "[ARGS]"}), ("noop", {})])
    for bad in ("[TOOL_CALLS]f", "[TOOL_CALLS]f[ARGS]{oops", "[TOOL_CALLS][ARGS]{}"):
        assert PLAN.parser.extract(bad).calls == []


def test_streamed():
    check_every_cut(PLAN, TWO, "", [("get_weather", {"city": "[Paris]"}), ("noop", {})])
    check_every_cut(PLAN, 'Hi [TOOL_CALLS][{"name": "f", "arguments": {"a": "b"}}]', "Hi ",
                    [("f", {"a": "b"})])


def test_malformed_text_is_plain_content():
    for text in ("Hello", "[TOOL_CALLS] not json", '[TOOL_CALLS][{"arguments": {}}]',
                 '[TOOL_CALLS][{"name": "f", "arguments": {"a": ]'):
        found = PLAN.parser.extract(text)
        assert found.calls == [] and found.content == text
    check_every_cut(PLAN, "x [TOOL_CALLS] oops", "x [TOOL_CALLS] oops", [])
    check_every_cut(PLAN, "[TOOL_ nope", "[TOOL_ nope", [])
