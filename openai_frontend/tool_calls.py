"""Tool calling on the chat route, as vLLM does it: what `tools` + `tool_choice` ask of
the engine, and how the generated text becomes OpenAI `tool_calls`.

- tool_choice named: the output is constrained (structured outputs) to the function's
  parameters schema, and the whole text is that one call's arguments.
- tool_choice "required": constrained to a JSON array of {"name", "parameters"} objects
  (one schema per tool, vLLM's shape), each element one call.
- tool_choice "auto" (the default with tools): nothing constrained; the model writes
  calls in its own format and the `--tool-call-parser` finds them (needs
  `--enable-auto-tool-choice`, as in vLLM).
- "none": tools reach the chat template only.

finish_reason follows vLLM: "tool_calls" when auto found calls or "required" stopped,
the engine's own reason for a named choice."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from openai_frontend.errors import bad_request
from openai_frontend.tool_parsers import Extracted, Scan, ToolCall, ToolParser, make_parser
from openai_frontend.tool_parsers.base import arguments_json
from openai_frontend.tool_parsers.json_calls import ScanCache, ready_calls


@dataclass(frozen=True, slots=True)
class ToolCallConfig:
    """The server's flags (vLLM's names): --tool-call-parser, --enable-auto-tool-choice."""
    parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.parser:
            make_parser(self.parser)  # an unknown name fails at startup, not per request


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's output is read back: kind, and the named function or parser."""
    kind: Literal["named", "required", "auto"]
    function: str | None = None
    parser: ToolParser | None = None
    # parallel_tool_calls=false: only the first call is returned (vLLM's filter).
    single_call: bool = False

    @property
    def keeps_special_tokens(self) -> bool:
        return self.parser is not None and self.parser.keeps_special_tokens


def make_call_id() -> str:
    # vLLM's form (make_tool_call_id): "chatcmpl-tool-" and 16 hex digits.
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any,
               parallel_tool_calls: bool | None,
               config: ToolCallConfig) -> tuple[ToolPlan | None, dict[str, Any] | None]:
    """(how to read the output, the structured-outputs constraint) for one request;
    the checks are vLLM's (ChatCompletionRequest.check_tool_usage), with its messages."""
    if tools is not None:
        if not tools:
            raise bad_request("`tools` must not be an empty array. Either provide at least "
                              "one tool or omit the field entirely.", "tools")
        for i, tool in enumerate(tools):
            _check_tool(i, tool)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None, None
    if not tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if tool_choice == "auto":
        if not config.enable_auto_tool_choice:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set", "tool_choice")
        return ToolPlan("auto", parser=make_parser(config.parser),
                        single_call=parallel_tool_calls is False), None
    if tool_choice == "required":
        return (ToolPlan("required", single_call=parallel_tool_calls is False),
                {"json": required_schema(tools, parallel_tool_calls)})
    if isinstance(tool_choice, dict):
        name = _named(tool_choice)
        by_name = {t["function"]["name"]: t["function"] for t in tools}
        if name not in by_name:
            raise bad_request("The tool specified in `tool_choice` does not match any of "
                              "the specified `tools`", "tool_choice")
        return ToolPlan("named", function=name), {"json": _parameters(by_name[name])}
    raise bad_request(f"Invalid value for `tool_choice`: {tool_choice}! Only named tools, "
                      '"none", "auto" or "required" are supported.', "tool_choice")


def required_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool | None) -> dict[str, Any]:
    """vLLM's schema for "required": a non-empty array whose items are one of the tools'
    {"name": <its name>, "parameters": <its parameters>}; $defs gathered at the top."""
    defs: dict[str, Any] = {}
    alternatives = []
    for tool in tools:
        function = tool["function"]
        parameters = dict(_parameters(function))
        for def_name, definition in (parameters.pop("$defs", None) or {}).items():
            if defs.get(def_name, definition) != definition:
                raise bad_request(f"Tool definition '{def_name}' has multiple schemas, which "
                                  "is not supported.", "tools")
            defs[def_name] = definition
        alternatives.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                            "parameters": parameters},
                             "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": alternatives}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _check_tool(index: int, tool: Any) -> None:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not function["name"]:
        raise bad_request(f"tools[{index}] must be {{\"type\": \"function\", \"function\": "
                          "{\"name\": ..., \"parameters\": {...}}}", "tools")
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        raise bad_request(f"tools[{index}].function.parameters must be a JSON schema object",
                          "tools")


def _named(tool_choice: dict[str, Any]) -> str:
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"Invalid value for `function`: `{function}` in `tool_choice`! "
                          f"{usage}", "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                          "tool_choice.function.name")
    return name


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    # A function without parameters still takes a JSON object (vLLM's rule).
    return function.get("parameters") or {"type": "object", "properties": {}}


# ---- reading the output back ----------------------------------------------------------

def extract(plan: ToolPlan, text: str) -> Extracted:
    """The finished text of one choice -> its calls and content."""
    if plan.kind == "named":
        return Extracted([ToolCall(plan.function, text)] if text.strip() else [], None)
    found = Extracted(_required_calls(text), None) if plan.kind == "required" \
        else plan.parser.extract(text)
    if plan.single_call and len(found.calls) > 1:
        return Extracted(found.calls[:1], found.content)
    return found


def _required_calls(text: str) -> list[ToolCall]:
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return []
    if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i
            for i in items):
        return []
    return [ToolCall(i["name"], arguments_json(i["parameters"])) for i in items]


def scan(plan: ToolPlan, text: str, cache: ScanCache) -> Scan:
    if plan.kind == "named":
        return Scan(0, [ToolCall(plan.function, text)] if text else [])
    if plan.kind == "required":
        return Scan(0, ready_calls(text, cache.calls(text, 0, arg_keys=("parameters",),
                                                     in_array=True)))
    return plan.parser.scan(text, cache)


def finish_reason(plan: ToolPlan | None, engine_reason: str | None, called: bool) -> str | None:
    if plan is None or engine_reason is None or plan.kind == "named":
        return engine_reason
    if called and (plan.kind == "auto" or engine_reason == "stop"):
        return "tool_calls"
    return engine_reason


def message_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": make_call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


@dataclass(slots=True)
class ToolStream:
    """One streamed choice: its text so far, and what of it was sent. Each piece of new
    text gives a content delta (the part surely not a call) and tool-call deltas: the
    first for a call carries index, id, type and name; later ones new argument text."""
    plan: ToolPlan
    text: str = ""
    content_sent: int = 0
    arguments_sent: list[int] = field(default_factory=list)
    cache: ScanCache = field(default_factory=ScanCache)

    @property
    def called(self) -> bool:
        return bool(self.arguments_sent)

    def feed(self, new_text: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += new_text
        found = scan(self.plan, self.text, self.cache)
        content = ""
        if not self.called and found.content_end > self.content_sent:
            content = self.text[self.content_sent:found.content_end]
            self.content_sent = found.content_end
        deltas = []
        for index, call in enumerate(found.calls[:1] if self.plan.single_call else found.calls):
            if index == len(self.arguments_sent):
                deltas.append({"index": index, "id": make_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                self.arguments_sent.append(len(call.arguments))
            elif len(call.arguments) > self.arguments_sent[index]:
                deltas.append({"index": index, "function": {
                    "arguments": call.arguments[self.arguments_sent[index]:]}})
                self.arguments_sent[index] = len(call.arguments)
        return content, deltas

    def flush(self) -> str:
        """At the end: text held back that never became a call is content after all."""
        if self.called or self.plan.kind != "auto":
            return ""
        rest = self.text[self.content_sent:]
        self.content_sent = len(self.text)
        return rest
