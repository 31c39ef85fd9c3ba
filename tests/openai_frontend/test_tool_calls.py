"""Tool calling on the chat route without a server: tools + tool_choice -> the
structured-outputs constraint and the ToolPlan (vLLM's rules), and generated text ->
OpenAI tool_calls, whole and streamed, checked with the openai package's own models."""
from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from openai_frontend.mapping import chat_request
from openai_frontend.protocol import ChatCompletionRequest
from openai_frontend.responses import ChatFormat, ChoiceState
from openai_frontend.streaming import events
from openai_frontend.tool_calls import ToolCallConfig, ToolPlan, plan_tools, required_schema
from openai_frontend.tool_parsers import make_parser
from openai_frontend.triton_client import Chunk
from tests.openai_frontend.refusals import refused

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
AUTO = ToolCallConfig("hermes", enable_auto_tool_choice=True)
USER = [{"role": "user", "content": "Weather in Paris?"}]


def test_named_choice_constrains_to_the_functions_parameters():
    plan, constraint = plan_tools(TOOLS, NAMED, None, ToolCallConfig())
    assert plan == ToolPlan("named", function="get_weather") and constraint == {"json": WEATHER}
    # A function without parameters still takes an object.
    _, constraint = plan_tools(TOOLS, {"type": "function", "function": {"name": "ping"}}, None,
                               ToolCallConfig())
    assert constraint == {"json": {"type": "object", "properties": {}}}
    req = ChatCompletionRequest(model="m", messages=USER, tools=TOOLS, tool_choice=NAMED)
    assert chat_request(req, "P", {"json": WEATHER}).sampling["structured_outputs"] == {"json": WEATHER}


def test_required_choice_constrains_to_an_array_of_calls():
    plan, constraint = plan_tools(TOOLS, "required", None, ToolCallConfig())
    assert plan.kind == "required"
    assert constraint == {"json": {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER},
         "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["ping"]},
                        "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"]}]}}}
    assert required_schema(TOOLS, parallel_tool_calls=False)["maxItems"] == 1
    with_defs = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}]
    schema = required_schema(with_defs, None)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in with_defs[0]["function"]["parameters"]  # the request's own tools untouched


def test_auto_needs_the_flags_and_none_constrains_nothing():
    assert plan_tools(None, None, None, ToolCallConfig()) == (None, None)
    assert plan_tools(TOOLS, "none", None, ToolCallConfig()) == (None, None)
    error = refused(lambda: plan_tools(TOOLS, None, None, ToolCallConfig()), "tool_choice")
    assert "--enable-auto-tool-choice" in error.message
    plan, constraint = plan_tools(TOOLS, "auto", None, AUTO)
    assert plan.kind == "auto" and plan.parser is not None and constraint is None
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ToolCallConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ToolCallConfig("nonesuch")


@pytest.mark.parametrize("tools,choice,param", [
    ([], None, "tools"),
    (None, "required", "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice.function"),
    (TOOLS, {"type": "function", "function": {"name": ""}}, "tool_choice.function.name"),
    ([{"type": "function", "function": {}}], "required", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "required", "tools"),
])
def test_bad_tool_requests_are_400(tools, choice, param):
    refused(lambda: plan_tools(tools, choice, None, AUTO), param)


def test_named_tool_and_another_constraint_conflict_but_required_replaces_it():
    schema = {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    named = ChatCompletionRequest(model="m", messages=USER, tools=TOOLS, tool_choice=NAMED,
                                  response_format=fmt)
    refused(lambda: chat_request(named, "P", {"json": WEATHER}), "tool_choice")
    required = ChatCompletionRequest(model="m", messages=USER, tools=TOOLS, tool_choice="required",
                                     response_format=fmt)
    constraint = {"json": required_schema(TOOLS, None)}
    assert chat_request(required, "P", constraint).sampling["structured_outputs"] == constraint


def whole(plan, text, reason="stop"):
    choice = ChatFormat("m", tools=plan).choice(0, text, reason, None, ChoiceState(), chunk=False)
    body = ChatFormat("m").body([choice], {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    return ChatCompletion.model_validate(body).choices[0]


def test_whole_responses_and_finish_reasons_as_vllm():
    named = whole(ToolPlan("named", function="get_weather"), '{"city": "Paris"}')
    assert named.finish_reason == "stop" and named.message.content == ""  # vLLM: stop for named
    (call,) = named.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "get_weather", {"city": "Paris"})
    assert call.id.startswith("chatcmpl-tool-")
    required = whole(ToolPlan("required"),
                     '[{"name": "get_weather", "parameters": {"city": "Lyon"}}, {"name": "ping", "parameters": {}}]')
    assert required.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in required.message.tool_calls] == [
        ("get_weather", '{"city": "Lyon"}'), ("ping", "{}")]
    assert len({c.id for c in required.message.tool_calls}) == 2
    # Cut off by max_tokens: the engine's reason stays.
    assert whole(ToolPlan("required"), '[{"name": "ping", "par', "length").finish_reason == "length"
    hermes = ToolPlan("auto", parser=make_parser("hermes"))
    auto = whole(hermes, 'Hm. <tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    assert auto.finish_reason == "tool_calls" and auto.message.content == "Hm. "
    plain = whole(hermes, "It is sunny.")
    assert plain.finish_reason == "stop" and plain.message.content == "It is sunny."
    assert not plain.message.tool_calls


def streamed(plan, pieces, reason="stop"):
    chunks = [(0, Chunk([p], [reason if i == len(pieces) - 1 else None], 3, [1], None,
                        i == len(pieces) - 1)) for i, p in enumerate(pieces)]
    req = chat_request(ChatCompletionRequest(model="m", messages=USER, stream=True), "P")

    async def run():
        async def rest():
            for item in chunks[1:]:
                yield item
        return [e async for e in events(chunks[0], rest(), req, ChatFormat("m", tools=plan))]

    out = asyncio.run(run())
    assert out[-1] == "data: [DONE]\n\n"
    return [ChatCompletionChunk.model_validate(json.loads(e[len("data: "):])) for e in out[:-1]]


def test_streamed_named_call():
    text = '{"city": "Paris"}'
    chunks = streamed(ToolPlan("named", function="get_weather"), [text[i:i + 3] for i in range(0, len(text), 3)])
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and deltas[0].tool_calls[0].function.name == "get_weather"
    assert deltas[0].tool_calls[0].id.startswith("chatcmpl-tool-")
    assert all(d.tool_calls[0].id is None and d.tool_calls[0].function.name is None for d in deltas[1:])
    assert "".join(d.tool_calls[0].function.arguments for d in deltas) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streamed_required_and_auto_calls_finish_with_tool_calls():
    text = '[{"name": "ping", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Nice"}}]'
    chunks = streamed(ToolPlan("required"), list(text))
    calls = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            calls.setdefault(d.index, ["", ""])
            calls[d.index][0] += d.function.name or ""
            calls[d.index][1] += d.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("ping", {}), ("get_weather", {"city": "Nice"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    hermes = ToolPlan("auto", parser=make_parser("hermes"))
    chunks = streamed(hermes, ["Ok ", "<tool", '_call>{"name": "ping", ', '"arguments": {}}', "</tool_call>"])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Ok "
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # No call after all: the held-back text arrives as content, and the reason stays.
    chunks = streamed(hermes, ["see ", "<tool", "box>"])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "see <toolbox>"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tools_and_past_calls_reach_the_chat_template():
    import copy

    from openai_frontend.chat import load_tokenizer, render_chat

    tokenizer = copy.deepcopy(load_tokenizer(None))
    # A template in the style of hermes/llama 3.1 ones: tools listed, past calls' arguments
    # read as a mapping.
    tokenizer.chat_template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }} city={{ c.function.arguments.city }}>"
        "{% endfor %}|{% endfor %}")
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    prompt = render_chat(tokenizer, history, add_generation_prompt=False, tools=TOOLS)
    assert prompt == ("[get_weather][ping]user:Weather in Paris?|"
                      "assistant:<get_weather city=Paris>|tool:sunny|")
    # The default model's own template takes the same conversation.
    assert "sunny" in render_chat(load_tokenizer(None), history, tools=TOOLS)


@pytest.mark.parametrize("plan,opening", [
    (ToolPlan("auto", parser=make_parser("llama3_json")), '{"name": "f", "parameters": {"s": "'),
    (ToolPlan("auto", parser=make_parser("hermes")), '<tool_call>{"name": "f", "arguments": {"s": "'),
    (ToolPlan("auto", parser=make_parser("mistral")), '[TOOL_CALLS]f[ARGS]{"s": "'),
    (ToolPlan("auto", parser=make_parser("pythonic")), '[f(s="'),
    (ToolPlan("required"), '[{"name": "f", "parameters": {"s": "'),
])
def test_a_long_unfinished_call_streams_in_one_pass(plan, opening):
    """A model writing 40,000 characters of a never-closed call, token by token: the
    scanners resume, so this is linear (a rescan per token would take minutes and hold
    the event loop, and every other request with it)."""
    import time

    from openai_frontend.tool_calls import ToolStream

    stream = ToolStream(plan)
    started = time.monotonic()
    stream.feed(opening)
    for _ in range(10_000):
        stream.feed("abcd")
    assert time.monotonic() - started < 10
    # Arguments went out as they grew; a pythonic call only once it is complete.
    assert stream.called == (not opening.startswith("[f("))


def test_auto_with_a_special_token_marker_keeps_special_tokens():
    # As vLLM's hermes and mistral parsers: their markers are special tokens in some
    # vocabularies, and skipping them would hide every call.
    for name, keeps in (("hermes", True), ("mistral", True), ("llama3_json", False), ("pythonic", False)):
        plan, _ = plan_tools(TOOLS, "auto", None, ToolCallConfig(name, True))
        assert plan.keeps_special_tokens is keeps
    req = ChatCompletionRequest(model="m", messages=USER, tools=TOOLS)
    assert chat_request(req, "P", None, keep_special_tokens=True).sampling["skip_special_tokens"] is False
    assert "skip_special_tokens" not in chat_request(req, "P").sampling


def test_parallel_tool_calls_false_keeps_the_first_call():
    from tests.openai_frontend.tool_parsers.streamed import assemble

    plan, _ = plan_tools(TOOLS, "auto", False, AUTO)
    text = ('<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call>')
    assert [(c.function.name, c.function.arguments) for c in whole(plan, text).message.tool_calls] \
        == [("ping", "{}")]
    assert assemble(plan, text, 7)[1] == [("ping", "{}")]
    assert len(whole(plan_tools(TOOLS, "auto", None, AUTO)[0], text).message.tool_calls) == 2
