"""--reasoning-parser on the chat route (openai_frontend/reasoning.py): crafted thinking-model
texts split into reasoning_content and content by the shipped parser, whole and streamed in
every chunking (no tag ever leaks), and the route's answers built from a fake Triton stream.
tests/conformance/test_reasoning_vllm.py compares the splits with vLLM 0.32's own parsers;
tests/e2e/test_openai_frontend.py runs the flag on the real server."""
from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from openai_frontend.mapping import chat_request
from openai_frontend.protocol import ChatCompletionRequest
from openai_frontend.reasoning import ReasoningParser, check_parser_name
from openai_frontend.responses import ChatFormat, ChoiceState
from openai_frontend.streaming import events
from openai_frontend.tool_calls import ToolCallConfig, plan_tools
from openai_frontend.triton_client import Chunk

# The <think> tag parsers (openai_gptoss reads harmony messages: tests/openai_frontend/test_harmony.py).
THINK_PARSERS = ("deepseek_r1", "qwen3")
PROMPT = "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
CALL = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'

# text -> (reasoning, content), for both parsers unless the qwen3 column differs.
CASES = [
    ("<think>Two and two.</think>Four.", ("Two and two.", "Four."), None),
    # The template wrote <think> into the prompt: the output starts inside reasoning.
    ("Two and two.</think>\n\nFour.", ("Two and two.", "\n\nFour."), None),
    # Cut off (or never closed): all reasoning, content null.
    ("<think>Still thinking", ("Still thinking", None), None),
    ("no tags at all", ("no tags at all", None), None),
    ("<think>r</think>", ("r", None), None),
    ("</think>", (None, None), None),
    ("", (None, None), None),
    ("pre<think>r</think>post", ("prer", "post"), None),
    # Only the first </think> ends it; what follows is content, as it is.
    ("<think>a</think>b</think>c", ("a", "b</think>c"), None),
    ("<think>a<think>b</think>c<think>d", ("ab", "c<think>d"), None),
    ("2 < 3 <th</think> so", ("2 < 3 <th", " so"), None),
    ("ends with a partial </thi", ("ends with a partial </thi", None), None),
    # qwen3: a tool call ends reasoning and stays in the content for the tool parser.
    (f"<think>r{CALL}", (f"r{CALL}", None), ("r", CALL)),
]


def split(name, text, prompt=PROMPT, **kwargs):
    return ReasoningParser(name).plan(prompt, kwargs or None).split(text)


@pytest.mark.parametrize("name", THINK_PARSERS)
@pytest.mark.parametrize("text, expected, qwen3", CASES)
def test_whole_text_splits(name, text, expected, qwen3):
    assert split(name, text) == (qwen3 if name == "qwen3" and qwen3 else expected)


def chunkings(text, parts):
    """Every way to cut `text` into `parts` pieces (empty pieces included)."""
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), parts - 1):
        bounds = (0, *cuts, len(text))
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("name", THINK_PARSERS)
@pytest.mark.parametrize("text", [t for t, _, _ in CASES if len(t) < 40])
def test_streamed_pieces_join_to_the_whole_split_in_every_chunking(name, text):
    plan = ReasoningParser(name).plan(PROMPT, None)
    whole = plan.split(text)
    for parts in (2, 3):
        for pieces in chunkings(text, parts):
            stream = plan.stream()
            reasoning, content = [], []
            for piece in pieces:
                r, c = stream.feed(piece)
                reasoning.append(r), content.append(c)
            r, c = stream.finish()
            reasoning.append(r), content.append(c)
            assert ("".join(reasoning) or None, "".join(content) or None) == whole, pieces


def test_a_split_tag_is_held_back_never_sent():
    stream = ReasoningParser("deepseek_r1").plan(PROMPT, None).stream()
    assert stream.feed("I think<") == ("I think", "")
    assert stream.feed("/thi") == ("", "")  # could still be </think>
    assert stream.feed("nk>The") == ("", "The")
    assert stream.feed(" answer</think>") == ("", " answer</think>")  # content: as it is
    stream = ReasoningParser("deepseek_r1").plan(PROMPT, None).stream()
    assert stream.feed("a <") == ("a ", "")
    assert stream.feed("b") == ("<b", "")  # not a tag after all: released


def test_qwen3_enable_thinking_false_is_all_content():
    text = "<think>a</think>b"
    assert split("qwen3", text, enable_thinking=False) == (None, text)
    assert split("qwen3", "", enable_thinking=False) == (None, "")
    # deepseek_r1 has no such switch (vLLM's).
    assert split("deepseek_r1", text, enable_thinking=False) == ("a", "b")


@pytest.mark.parametrize("name", THINK_PARSERS)
def test_a_prompt_that_closed_reasoning_makes_all_content(name):
    closed = PROMPT + "<think>\n\n</think>\n\n"
    assert split(name, "Four.</think>x", prompt=closed) == (None, "Four.</think>x")
    # Opened in the prompt (DeepSeek-R1's template), or nothing there: reasoning first.
    assert split(name, "a</think>b", prompt=PROMPT + "<think>\n") == ("a", "b")
    earlier_turn = "<think>x</think>old answer<|im_end|>\n<|im_start|>assistant\n"
    expected = ("a", "b") if name == "qwen3" else (None, "a</think>b")
    # qwen3 looks back only through the last turn (vLLM's turn boundaries).
    assert split(name, "a</think>b", prompt=earlier_turn) == expected


def test_a_constrained_request_is_all_content():
    plan = ReasoningParser("deepseek_r1").plan(PROMPT, None, constrained=True)
    assert plan.split('{"a": 1}') == (None, '{"a": 1}')


def test_unknown_parser_names_are_refused_naming_the_supported_ones():
    with pytest.raises(ValueError,
                       match="unknown reasoning parser 'r1'; supported: deepseek_r1, openai_gptoss, qwen3"):
        check_parser_name("r1")
    from openai_frontend.options import FrontendOptions

    with pytest.raises(ValueError, match="supported: deepseek_r1, openai_gptoss, qwen3"):
        FrontendOptions(reasoning_parser="granite")
    from openai_frontend.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--reasoning-parser", "granite"])
    assert parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    assert parse_args([]).reasoning_parser is None


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


def joined(chunks, field):
    return "".join(c["choices"][0]["delta"].get(field) or "" for c in chunks if c["choices"])


def test_streamed_chat_chunks_carry_reasoning_deltas_and_never_a_tag():
    pieces = ["<th", "ink>Two", " and two.</", "think", ">\n\nFo", "ur."]
    plan = ReasoningParser("deepseek_r1").plan(PROMPT, None)
    chunks = streamed_chunks(ChatFormat("m", reasoning=plan), pieces)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        delta = chunk["choices"][0]["delta"]
        assert delta.get("reasoning_content") == delta.get("reasoning")
        assert "think" not in (delta.get("content") or "") + (delta.get("reasoning") or "")
    assert joined(chunks, "reasoning_content") == "Two and two."
    assert joined(chunks, "content") == "\n\nFour."
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_stream_cut_off_inside_reasoning_releases_the_held_tail_as_reasoning():
    plan = ReasoningParser("qwen3").plan(PROMPT, None)
    chunks = streamed_chunks(ChatFormat("m", reasoning=plan), ["<think>Hmm, 1 <", "/thi"],
                             reason="length")
    assert joined(chunks, "reasoning_content") == "Hmm, 1 </thi" and joined(chunks, "content") == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def whole_message(fmt, text, reason="stop"):
    body = fmt.body([fmt.choice(0, text, reason, None, ChoiceState(), chunk=False)], None)
    ChatCompletion.model_validate({**body, "usage": None})
    return body["choices"][0]["message"]


def test_whole_chat_message_has_reasoning_content_and_content():
    plan = ReasoningParser("deepseek_r1").plan(PROMPT, None)
    message = whole_message(ChatFormat("m", reasoning=plan), "Two and two.</think>Four.")
    assert (message["reasoning_content"], message["reasoning"], message["content"]) == \
        ("Two and two.", "Two and two.", "Four.")
    message = whole_message(ChatFormat("m", reasoning=plan), "cut off", reason="length")
    assert (message["reasoning_content"], message["content"]) == ("cut off", None)
    # Without --reasoning-parser nothing changes: no reasoning fields at all.
    message = whole_message(ChatFormat("m"), "Two.</think>Four.")
    assert message["content"] == "Two.</think>Four." and "reasoning_content" not in message


def test_qwen3_reasoning_then_a_tool_call_whole_and_streamed():
    tools = [{"type": "function", "function": {"name": "ping"}}]
    tool_plan, _ = plan_tools(tools, "auto", None, ToolCallConfig("hermes", True))
    plan = ReasoningParser("qwen3").plan(PROMPT, None)
    text = f"<think>I should ping.</think>\n{CALL}"
    message = whole_message(ChatFormat("m", tools=tool_plan, reasoning=plan), text)
    assert message["reasoning_content"] == "I should ping."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["ping"]
    chunks = streamed_chunks(ChatFormat("m", tools=tool_plan, reasoning=plan),
                             [text[i:i + 5] for i in range(0, len(text), 5)])
    assert joined(chunks, "reasoning_content") == "I should ping."
    calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "ping"
    assert "tool_call" not in joined(chunks, "content")
    # A call the model writes while still thinking ends the reasoning (qwen3's rule).
    message = whole_message(ChatFormat("m", tools=tool_plan, reasoning=plan), f"hmm{CALL}")
    assert message["reasoning_content"] == "hmm" and message["tool_calls"]


# ---- the route itself, with a fake `llm` model behind it -------------------------------

class FakeLLM:
    """Answers with `pieces` (streamed) or their join (whole), recording what it was sent."""

    def __init__(self, real, pieces=("<think>Two", " and two.</th", "ink>Four.")) -> None:
        self.real, self.pieces = real, list(pieces)
        self.sent: list[tuple[str, dict]] = []

    async def generate(self, prompt, sampling, stream, logprobs):
        self.sent.append((prompt, dict(sampling)))
        pieces = self.pieces if stream else ["".join(self.pieces)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield Chunk([piece], ["stop" if last else None], 4, [1], None, final=last)

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        await self.real.close()


@pytest.fixture(scope="module")
def think_tokenizer_dir(tmp_path_factory):
    """A small tokenizer with <think> and </think> as tokens, special ones when asked."""
    from transformers import AutoTokenizer

    from testing.bos_tokenizer import make_bos_tokenizer_dir

    def make(special: bool):
        path = make_bos_tokenizer_dir(tmp_path_factory.mktemp("think"))
        tok = AutoTokenizer.from_pretrained(path)
        if special:
            tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
        else:
            tok.add_tokens(["<think>", "</think>"])
        tok.save_pretrained(path)
        return AutoTokenizer.from_pretrained(path)

    return make


def route(tokenizer, parser):
    from fastapi.testclient import TestClient

    from openai_frontend.app import create_app
    from openai_frontend.options import FrontendOptions

    app = create_app("127.0.0.1:1", "llm", "served", tokenizer,
                     FrontendOptions(reasoning_parser=parser))
    client = TestClient(app)
    client.__enter__()
    app.state.llm = llm = FakeLLM(app.state.llm)
    return client, llm


def post_chat(client, **body):
    return client.post("/v1/chat/completions", json={
        "model": "served", "messages": [{"role": "user", "content": "how are you"}], **body})


def test_the_route_answers_with_reasoning_content_whole_and_streamed(think_tokenizer_dir):
    client, llm = route(think_tokenizer_dir(special=False), "deepseek_r1")
    try:
        message = post_chat(client).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Two and two.", "Four.")
        # Non-special tags decode anyway: skip_special_tokens stays the client's.
        assert "skip_special_tokens" not in llm.sent[-1][1]
        with client.stream("POST", "/v1/chat/completions", json={
                "model": "served", "stream": True,
                "messages": [{"role": "user", "content": "how are you"}]}) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        chunks = [json.loads(line[len("data: "):]) for line in lines]
        assert joined(chunks, "reasoning_content") == "Two and two."
        assert joined(chunks, "content") == "Four."
        # Completions are not split (vLLM's: reasoning parsers serve chat).
        text = client.post("/v1/completions", json={"model": "served", "prompt": "how"}).json()
        assert text["choices"][0]["text"] == "<think>Two and two.</think>Four."
        # A constrained request's text is all content: this engine constrains from token one.
        message = post_chat(client, response_format={"type": "json_object"}).json()
        assert message["choices"][0]["message"]["content"] == "<think>Two and two.</think>Four."
    finally:
        client.__exit__(None, None, None)


def test_special_tags_make_the_route_keep_special_tokens(think_tokenizer_dir):
    tokenizer = think_tokenizer_dir(special=True)
    assert ReasoningParser.for_tokenizer("qwen3", tokenizer).keeps_special_tokens
    client, llm = route(tokenizer, "qwen3")
    try:
        post_chat(client)
        assert llm.sent[-1][1]["skip_special_tokens"] is False
        message = post_chat(client, chat_template_kwargs={"enable_thinking": False}).json()
        message = message["choices"][0]["message"]
        assert message["content"] == "<think>Two and two.</think>Four."
        assert message["reasoning_content"] is None
    finally:
        client.__exit__(None, None, None)
