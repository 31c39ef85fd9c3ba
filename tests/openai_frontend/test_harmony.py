"""gpt-oss's harmony answers on the chat route: `--reasoning-parser openai_gptoss` splits
the messages into reasoning_content and content, `--tool-call-parser openai` turns a
message to `functions.NAME` into a tool call (openai_frontend/reasoning.py,
openai_frontend/tool_parsers/harmony.py). Crafted harmony texts, whole and streamed cut
into every pair of pieces and character by character (same answer, no tag ever leaks),
then the route itself with a fake `llm` model and a tokenizer whose harmony tags are
special tokens."""
from __future__ import annotations

import asyncio
import json
import random

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from openai_frontend.mapping import chat_request
from openai_frontend.protocol import ChatCompletionRequest
from openai_frontend.reasoning import ReasoningParser
from openai_frontend.responses import ChatFormat, ChoiceState
from openai_frontend.streaming import events
from openai_frontend.tool_calls import ToolCallConfig, ToolStream, plan_tools
from openai_frontend.tool_parsers import make_parser
from openai_frontend.tool_parsers.harmony import HEADER_LIMIT, TAGS
from openai_frontend.triton_client import Chunk
from tests.openai_frontend.test_reasoning import FakeLLM
from tests.openai_frontend.tool_parsers.streamed import check_every_cut

# The prompt ends with `<|start|>assistant` (gpt-oss's template), so answers open at
# <|channel|>; the engine leaves out the text of the stop tokens <|return|> and <|call|>.
PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
ANALYSIS = "<|channel|>analysis<|message|>User wants the weather. Call get_weather.<|end|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris", "note": "a <| b"}')
# The older header form, the recipient after the role (what vLLM renders past calls as).
LEGACY_CALL = ('<|start|>assistant to=functions.get_weather<|channel|>commentary json'
               '<|message|>{"city": "Paris"}<|call|>')
ARGS = {"city": "Paris", "note": "a <| b"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
OPENAI = plan_tools(TOOLS, "auto", None, ToolCallConfig("openai", True))[0]

# text -> (reasoning_content, content) with --reasoning-parser openai_gptoss.
CASES = [
    # analysis only (cut off before any answer): reasoning, content null.
    ("<|channel|>analysis<|message|>Two and two.<|end|>", ("Two and two.", None)),
    ("<|channel|>analysis<|message|>Still thin", ("Still thin", None)),
    # final only, with and without the <|return|> the engine leaves out.
    ("<|channel|>final<|message|>Four.<|return|>", (None, "Four.")),
    ("<|channel|>final<|message|>Four.", (None, "Four.")),
    ("<|channel|>analysis<|message|>Two and two.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Four.", ("Two and two.", "Four.")),
    # Several messages of one field are joined by a newline (vLLM's whole answer).
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b"
     "<|end|><|start|>assistant<|channel|>commentary<|message|>c<|end|>"
     "<|start|>assistant<|channel|>final<|message|>d", ("a\nb", "c\nd")),
    # An empty message adds no newline.
    ("<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>analysis<|message|>b",
     ("b", None)),
    # Text that only looks like the start of a tag stays text.
    ("<|channel|>final<|message|>x <|y|> <|en", (None, "x <|y|> <|en")),
    # A message to a built-in tool is no answer (vLLM drops it).
    (ANALYSIS + '<|start|>assistant<|channel|>commentary to=browser.search json<|message|>{"q": 1}',
     ("User wants the weather. Call get_weather.", None)),
    # A tool call's message stays in the content as it is, for --tool-call-parser openai.
    (ANALYSIS + PREAMBLE + CALL, ("User wants the weather. Call get_weather.",
                                  "Let me check." + CALL)),
    # The next header cut the call short: it is ended with <|call|> for the tool parser.
    ('<|channel|>commentary to=functions.f json<|message|>{}<|start|>assistant<|channel|>final'
     '<|message|>ok', (None, '<|channel|>commentary to=functions.f json<|message|>{}<|call|>ok')),
    # Malformed, best effort and never an error: no header at all is content ...
    ("Hello there", (None, "Hello there")),
    ("to be or not", (None, "to be or not")),
    ("", (None, None)),
    # ... so is a header the output stopped in, or one broken off by an end tag ...
    ("<|channel|>analy", (None, "<|channel|>analy")),
    ("<|channel|>final<|end|>x", (None, "<|channel|>final\nx")),
    # ... one without a channel, and a stray answer after a header-less start.
    ("<|start|>assistant<|message|>no channel", (None, "no channel")),
    ("oops<|channel|>final<|message|>Four.", (None, "oops\nFour.")),
    # A header that never reaches <|message|> is not one: content, as it is.
    ("<|channel|>" + "x" * (HEADER_LIMIT + 20), (None, "<|channel|>" + "x" * (HEADER_LIMIT + 20))),
]


def plan(constrained=False):
    return ReasoningParser("openai_gptoss").plan(PROMPT, None, constrained=constrained)


@pytest.mark.parametrize("text, expected", CASES)
def test_whole_answers_split_into_reasoning_and_content(text, expected):
    assert plan().split(text) == expected


def cuts(text):
    """Every cut into two pieces, and one piece per character."""
    for at in range(len(text) + 1):
        yield [text[:at], text[at:]]
    yield list(text)


def streamed_split(pieces):
    stream = plan().stream()
    reasoning, content = [], []
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning.append(r), content.append(c)
    r, c = stream.finish()
    reasoning.append(r), content.append(c)
    return ("".join(reasoning) or None, "".join(content) or None)


@pytest.mark.parametrize("text, expected", CASES)
def test_streamed_pieces_join_to_the_whole_split_in_every_cut(text, expected):
    # Where the answer holds no tag, equal joins also mean no piece of a tag went out.
    for pieces in cuts(text):
        assert streamed_split(pieces) == expected, pieces


def test_a_held_tag_is_released_only_when_decided():
    stream = plan().stream()
    assert stream.feed("<|chan") == ("", "")
    assert stream.feed("nel|>analysis<|mess") == ("", "")  # the header is not whole yet
    assert stream.feed("age|>Hm<|e") == ("Hm", "")
    assert stream.feed("nd|><|start|>assistant<|channel|>final<|message|>4") == ("", "4")
    assert stream.finish() == ("", "")


def test_tag_soup_never_fails_and_any_cut_gives_the_whole_answer():
    """Random mixes of tags and text (models stray): no exception, and the streamed split
    and calls in random cuts are those of the whole text."""
    rng = random.Random(45)
    atoms = [*TAGS, "assistant", "analysis", "final", "commentary", " to=functions.f",
             " to=python", " json", '{"a": 1}', "hi", "<|", "|>", " ", "to=", "x" * 40]
    for _ in range(400):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))
        bounds = sorted({0, len(text), *(rng.randint(0, len(text)) for _ in range(4))})
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        assert streamed_split(pieces) == plan().split(text), pieces
        found = OPENAI.parser.extract(text)
        stream = ToolStream(OPENAI)
        names = [d["function"]["name"] for p in pieces for d in stream.feed(p)[1] if "id" in d]
        assert names == [c.name for c in found.calls], text


def test_a_constrained_request_is_all_content():
    # The engine constrains from the first token, so no header is ever written.
    assert plan(constrained=True).split('{"a": 1}') == (None, '{"a": 1}')


# ---- --tool-call-parser openai ----------------------------------------------------------

def test_calls_behind_the_reasoning_parser_whole_and_in_every_cut():
    for raw, content, args in ((ANALYSIS + PREAMBLE + CALL, "Let me check.", ARGS),
                               (ANALYSIS + CALL + "<|call|>", "", ARGS),
                               (LEGACY_CALL, "", {"city": "Paris"})):
        _, text = plan().split(raw)
        found = OPENAI.parser.extract(text)
        assert found.content == (content or None)
        assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [("get_weather", args)]
        check_every_cut(OPENAI, text, content, [("get_weather", args)])


def test_whole_arguments_are_json_re_serialised_and_other_content_types_kept():
    found = OPENAI.parser.extract('<|channel|>commentary to=functions.f json<|message|>'
                                  '{ "q" :"é" }<|call|>')
    assert found.calls[0].arguments == '{"q": "é"}'
    found = OPENAI.parser.extract('<|channel|>commentary to=f <|constrain|>json<|message|>{"a":')
    assert [(c.name, c.arguments) for c in found.calls] == [("f", '{"a":')]  # cut off: as it is
    found = OPENAI.parser.extract('<|channel|>commentary to=functions.run code<|message|>ls -l')
    assert found.calls[0].arguments == "ls -l"


def test_the_parser_alone_on_raw_harmony_still_finds_the_calls():
    raw = ANALYSIS + PREAMBLE + CALL
    found = OPENAI.parser.extract(raw)
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [("get_weather", ARGS)]
    check_every_cut(OPENAI, raw, "", [("get_weather", ARGS)])


def test_text_without_a_call_is_content_as_it_is():
    for text in ("It is sunny.", "Let me check.<|channel|>commentary to=python<|message|>1+1"):
        assert OPENAI.parser.extract(text).calls == []
        assert OPENAI.parser.extract(text).content == text
        check_every_cut(OPENAI, text, text, [])


# ---- both together on the chat answer ---------------------------------------------------

def streamed_chunks(fmt, pieces, reason="stop"):
    chunks = [(0, Chunk([p], [reason if i == len(pieces) - 1 else None], 3, [1], None,
                        i == len(pieces) - 1)) for i, p in enumerate(pieces)]
    req = chat_request(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                             stream=True), "P")

    async def run():
        async def rest():
            for item in chunks[1:]:
                yield item
        return [e async for e in events(chunks[0], rest(), req, fmt)]

    out = asyncio.run(run())
    assert out[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in out[:-1]]


def answer_from_chunks(chunks):
    """(reasoning, content, [(name, arguments)], finish_reason) as a client assembles them."""
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        delta = chunk["choices"][0]["delta"]
        assert delta.get("reasoning_content") == delta.get("reasoning")
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name") or ""
            entry[1] += call["function"].get("arguments") or ""
    return (reasoning or None, content or None, [tuple(c) for c in calls.values()],
            chunks[-1]["choices"][0]["finish_reason"])


def whole_answer(fmt, text):
    body = fmt.body([fmt.choice(0, text, "stop", None, ChoiceState(), chunk=False)], None)
    ChatCompletion.model_validate({**body, "usage": None})
    message = body["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    reason = body["choices"][0]["finish_reason"]
    return message["reasoning_content"], message["content"], calls, reason


@pytest.mark.parametrize("text, expected", [
    (ANALYSIS + PREAMBLE + CALL, ("User wants the weather. Call get_weather.", "Let me check.",
                                  [("get_weather", ARGS)], "tool_calls")),
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny.",
     ("User wants the weather. Call get_weather.", "Sunny.", [], "stop")),
    ("<|channel|>final<|message|>Sunny.<|return|>", (None, "Sunny.", [], "stop")),
    ("Sunny, no harmony.", (None, "Sunny, no harmony.", [], "stop")),
])
def test_chat_answers_whole_and_streamed_in_every_cut_agree(text, expected):
    fmt = ChatFormat("m", tools=OPENAI, reasoning=plan())

    def decoded(answer):
        reasoning, content, calls, reason = answer
        return reasoning, content, [(n, json.loads(a)) for n, a in calls], reason

    assert decoded(whole_answer(fmt, text)) == expected
    for pieces in cuts(text):
        pieces = [p for p in pieces if p] or [""]
        chunks = streamed_chunks(ChatFormat("m", tools=OPENAI, reasoning=plan()), pieces)
        assert decoded(answer_from_chunks(chunks)) == expected, pieces
        assert not any("<|" in (c["choices"][0]["delta"].get("content") or "") for c in chunks)


def test_without_tools_the_reasoning_parser_alone_splits_the_answer():
    text = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny."
    reasoning, content, calls, reason = whole_answer(ChatFormat("m", reasoning=plan()), text)
    assert (reasoning, content, calls, reason) == (
        "User wants the weather. Call get_weather.", "Sunny.", [], "stop")


# ---- the route itself, with a fake `llm` model behind it -------------------------------

@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory):
    """A small tokenizer with the harmony tags as special tokens, as gpt-oss's has them."""
    from transformers import AutoTokenizer

    from testing.bos_tokenizer import make_bos_tokenizer_dir

    path = make_bos_tokenizer_dir(tmp_path_factory.mktemp("harmony"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": list(TAGS)})
    tok.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def test_the_route_answers_gpt_oss_with_reasoning_content_and_tool_calls(harmony_tokenizer):
    from fastapi.testclient import TestClient

    from openai_frontend.app import create_app
    from openai_frontend.options import FrontendOptions

    assert ReasoningParser.for_tokenizer("openai_gptoss", harmony_tokenizer).keeps_special_tokens
    text = ANALYSIS + PREAMBLE + CALL
    app = create_app("127.0.0.1:1", "llm", "served", harmony_tokenizer, FrontendOptions(
        reasoning_parser="openai_gptoss", tool_calls=ToolCallConfig("openai", True)))
    with TestClient(app) as client:
        pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
        app.state.llm = llm = FakeLLM(app.state.llm, pieces)
        body = {"model": "served", "messages": [{"role": "user", "content": "how are you"}],
                "tools": TOOLS}
        reply = client.post("/v1/chat/completions", json=body).json()
        # The tags are special tokens: the engine is asked to keep them in the text.
        assert llm.sent[-1][1]["skip_special_tokens"] is False
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["reasoning_content"] == "User wants the weather. Call get_weather."
        assert message["content"] == "Let me check."
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == \
            ("get_weather", ARGS)
        with client.stream("POST", "/v1/chat/completions",
                           json={**body, "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        chunks = [json.loads(line[len("data: "):]) for line in lines]
        reasoning, content, calls, reason = answer_from_chunks(chunks)
        assert (reasoning, content, reason) == (message["reasoning_content"], "Let me check.",
                                                "tool_calls")
        assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", ARGS)]
        # Without tools the call stays in the content, as the model wrote it.
        reply = client.post("/v1/chat/completions", json={**body, "tools": None}).json()
        assert reply["choices"][0]["message"]["content"] == "Let me check." + CALL


def test_the_flags_take_vllms_names():
    from openai_frontend.__main__ import parse_args

    args = parse_args(["--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai",
                       "--enable-auto-tool-choice"])
    assert (args.reasoning_parser, args.tool_call_parser) == ("openai_gptoss", "openai")
    assert make_parser("openai").keeps_special_tokens
