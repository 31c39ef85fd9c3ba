"""The OpenAI route's tool calling, /tokenize and /detokenize against vLLM 0.32's own
code: its tool parsers read the same texts into the same calls, its tool_choice schemas
are ours, and its protocol classes accept our response bodies."""
from __future__ import annotations

import asyncio
import json

from openai_frontend.chat import default_tokenizer_path, load_tokenizer
from openai_frontend.mapping import chat_request
from openai_frontend.protocol import ChatCompletionRequest
from openai_frontend.responses import ChatFormat, ChoiceState
from openai_frontend.streaming import events
from openai_frontend.tokenization import (DetokenizeRequest, TokenizeChatRequest,
                                          TokenizeCompletionRequest, detokenize, tokenize)
from openai_frontend.tool_calls import ToolCallConfig, ToolPlan, plan_tools
from openai_frontend.tool_parsers import make_parser
from openai_frontend.triton_client import Chunk

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "d": {"$ref": "#/$defs/D"}},
             "$defs": {"D": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "ping"}}]

CASES = {
    "hermes": ['Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
               '<tool_call>{"name": "ping", "arguments": {}}</tool_call>\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Nice, FR"}}\n</tool_call>',
               '<tool_call>{"name": "ping", "arguments": {}}',
               "just text", '<tool_call>{"name": broken}</tool_call>'],
    "llama3_json": ['<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                    '{"name": "ping", "parameters": {}}; {"name": "get_weather", "arguments": {"city": "x"}}',
                    "no call", '{"name": "ping"}'],
    "mistral": ['[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
                'Sure [TOOL_CALLS]ping[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "é"}',
                "plain"],
    "pythonic": ['[get_weather(city="Lima"), ping()]', '[get_weather(city=null, d=3)]',
                 "It is sunny.", "[get_weather(1)]"],
}

# vLLM's parsers need their marker tokens in the vocabulary; SmolLM2's tokenizer gets them.
_PARSE = """
import json, sys
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers import ToolParserManager
p = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained(p["tokenizer"])
tok.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"]})
req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=p["tools"])
out = {}
for name, texts in p["cases"].items():
    for text in texts:
        info = ToolParserManager.get_tool_parser(name)(tok, req.tools).extract_tool_calls(text, req)
        out.setdefault(name, []).append({"content": info.content, "calls": [
            [c.function.name, json.loads(c.function.arguments)] for c in info.tool_calls]})
print(json.dumps(out))
"""


def test_our_parsers_read_what_vllms_read(vllm_side):
    theirs = vllm_side.run(_PARSE, {"tokenizer": str(default_tokenizer_path()), "tools": TOOLS,
                                    "cases": CASES})
    for name, texts in CASES.items():
        parser = make_parser(name)
        for text, vllm in zip(texts, theirs[name]):
            ours = parser.extract(text)
            assert [[c.name, json.loads(c.arguments)] for c in ours.calls] == vllm["calls"], (name, text)
            assert ours.content == vllm["content"], (name, text)


_SCHEMAS = """
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.utils import get_json_schema_from_tools
p = json.load(sys.stdin)
out = []
for choice, parallel in p["choices"]:
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                tools=p["tools"], tool_choice=choice, parallel_tool_calls=parallel)
    out.append(get_json_schema_from_tools(req.tool_choice, req.tools, req.parallel_tool_calls))
print(json.dumps(out))
"""


def test_tool_choice_constraints_are_vllms(vllm_side):
    choices = [["required", None], ["required", False],
               [{"type": "function", "function": {"name": "get_weather"}}, None],
               [{"type": "function", "function": {"name": "ping"}}, None]]
    theirs = vllm_side.run(_SCHEMAS, {"tools": TOOLS, "choices": choices})
    ours = [plan_tools(json.loads(json.dumps(TOOLS)), c, p, ToolCallConfig())[1]["json"]
            for c, p in choices]
    # vLLM moves $defs out of the named tool's parameters too (it pops them from the request's
    # tools while building "required"), so compare the named schemas without them.
    assert ours[:2] == theirs[:2]
    assert {k: v for k, v in ours[2].items() if k != "$defs"} == \
        {k: v for k, v in theirs[2].items() if k != "$defs"}
    assert ours[3] == theirs[3]


_VALIDATE = """
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionResponse,
    ChatCompletionStreamResponse)
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeResponse, TokenizeResponse
p = json.load(sys.stdin)
out = {}
for key, cls in (("tokenize", TokenizeResponse), ("detokenize", DetokenizeResponse),
                 ("chat", ChatCompletionResponse)):
    model = cls.model_validate(p[key])
    out[key] = {"fields": sorted(cls.model_fields), "extra": sorted(model.model_extra or {}),
                "dump": model.model_dump(mode="json")}
out["chunks"] = [ChatCompletionStreamResponse.model_validate(c).model_dump(mode="json", exclude_none=True)
                 for c in p["chunks"]]
print(json.dumps(out))
"""


def test_vllms_protocol_classes_accept_our_bodies(vllm_side):
    tokenizer = load_tokenizer(None)
    tok = tokenize(tokenizer, TokenizeCompletionRequest(prompt="Hello there", return_token_strs=True), 2048)
    chat_tok = tokenize(tokenizer, TokenizeChatRequest(messages=[{"role": "user", "content": "Hi"}]), 2048)
    detok = detokenize(tokenizer, DetokenizeRequest(tokens=tok["tokens"]))
    plan = ToolPlan("required")
    text = '[{"name": "ping", "parameters": {}}]'
    fmt = ChatFormat("m", tools=plan)
    chat = fmt.body([fmt.choice(0, text, "stop", None, ChoiceState(), chunk=False)],
                    {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3})
    req = chat_request(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                             stream=True), "P")

    async def stream():
        async def rest():
            yield 0, Chunk([text[10:]], ["stop"], 1, [1], None, True)
        return [e async for e in events((0, Chunk([text[:10]], [None], 1, [1], None, False)),
                                        rest(), req, ChatFormat("m", tools=plan))]

    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(stream())[:-1]]
    theirs = vllm_side.run(_VALIDATE, {"tokenize": tok, "detokenize": detok, "chat": chat,
                                       "chunks": chunks})
    for key, ours in (("tokenize", tok), ("detokenize", detok)):
        assert theirs[key]["extra"] == [] and sorted(ours) == theirs[key]["fields"]
        assert theirs[key]["dump"] == ours
    assert chat_tok["count"] == len(chat_tok["tokens"])
    message = theirs["chat"]["dump"]["choices"][0]["message"]
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "ping", "arguments": "{}"}]
    assert theirs["chat"]["dump"]["choices"][0]["finish_reason"] == "tool_calls"
    deltas = [c["choices"][0]["delta"] for c in theirs["chunks"] if c["choices"]]
    first = next(d["tool_calls"][0] for d in deltas if d.get("tool_calls"))
    assert first["function"]["name"] == "ping" and first["id"].startswith("chatcmpl-tool-")
