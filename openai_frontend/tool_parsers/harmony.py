"""gpt-oss's harmony format, read from the detokenized text (special tokens kept), and the
`openai` tool-call parser (vLLM's name) built on it.

An answer is a sequence of messages `<|start|>assistant<|channel|>CHANNEL<|message|>TEXT`
each ended by `<|end|>`, `<|return|>` (the final answer) or `<|call|>` (a tool call); the
prompt already holds the first `<|start|>assistant`, so an answer opens at `<|channel|>`.
The engine leaves the text of the stop tokens (`<|return|>`, `<|call|>`) out, so the last
message usually has no end. A header may name a recipient, in the role part
(`<|start|>assistant to=functions.f<|channel|>commentary json`) or after the channel
(`<|channel|>commentary to=functions.f <|constrain|>json`), and a content type.

What a message is, by vLLM's rules (its HarmonyParser): a function recipient
(`functions.NAME`, or a bare name that is not one of the built-in tools) makes a tool call
to NAME; otherwise `analysis` is reasoning, `final` and `commentary` (a preamble) are
content, and a commentary message to a built-in tool (python, browser, container) is
dropped.
Best effort where the model strays, never an error: text outside any header, a header
that never reaches `<|message|>`, and a header without a (known) channel are content.

The reader is incremental and prefix-stable: fed a text in any pieces, it finds the same
messages with the same bodies, and a body only ever grows; a tag split across pieces is
held back until it is whole or cannot be one, so no tag reaches a body."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

from openai_frontend.tool_parsers.base import (Extracted, Scan, ToolCall, arguments_json,
                                               earliest_tag, partial_tag_length, plain)
from openai_frontend.tool_parsers.json_calls import ScanCache

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"
RETURN, CALL, ENDOFTEXT = "<|return|>", "<|call|>", "<|endoftext|>"
TAGS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, ENDOFTEXT)

REASONING, CONTENT, TOOL_CALL, DROPPED = "reasoning", "content", "call", "dropped"

# What may open a header where a message begins: the tags, and the recipient in the role
# part of an answer's first message (its `<|start|>assistant` is in the prompt).
_OPENERS = (START, CHANNEL, " to=", "to=")
# Tags that end a body (dropped), and tags that open the next header without an end.
_ENDS = (END, RETURN, CALL, ENDOFTEXT)
_NEXT = (START, CHANNEL)
_BODY_STOPS = _ENDS + _NEXT
# A header that has not reached <|message|> within this many characters is not one (names
# and content types are short): its text is content, and the answer streams on.
HEADER_LIMIT = 256
_LONGEST_TAG = max(map(len, TAGS))
# vLLM's built-in tools: a message to them is no function call.
_BUILTIN_TOOLS = ("python", "browser", "container")

_AT_START, _IN_HEADER, _IN_BODY = range(3)


@dataclass(slots=True, eq=False)
class Message:
    kind: str
    # The raw header through <|message|>; "" for text outside any header.
    header: str = ""
    # The function a tool call goes to.
    name: str | None = None
    content_type: str | None = None
    body: str = ""
    # The tag that ended it; None when the next header or the end of the text did.
    end: str | None = None


class Event(NamedTuple):
    # "open" (text: the raw header), "text" (a piece of the body) or "close" (text: the
    # ending tag, "" when the next header ended it).
    what: str
    message: Message
    text: str


class HarmonyReader:
    """Reads a harmony answer as it arrives: feed(piece) -> events now known; finish()
    releases what was held back (an unfinished header or tag is content, as it is)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.fed = 0  # characters fed so far (the tool parser's scan resumes there)
        self._held = ""
        self._state = _AT_START
        self._current: Message | None = None

    def feed(self, text: str) -> list[Event]:
        self.fed += len(text)
        buffer, self._held = self._held + text, ""
        events: list[Event] = []
        pos = 0
        while True:
            if self._state == _AT_START:
                rest = buffer[pos:]
                if any(rest.startswith(o) for o in _OPENERS):
                    self._state = _IN_HEADER
                elif not rest or any(o.startswith(rest) for o in _OPENERS):
                    break  # undecided: wait for more
                else:
                    self._open(Message(CONTENT), events)
            elif self._state == _IN_HEADER:
                pos = self._header(buffer, pos, events)
                if self._state == _IN_HEADER:
                    break
            else:
                found = earliest_tag(buffer, pos, _BODY_STOPS)
                if found is None:
                    keep = partial_tag_length(buffer, _BODY_STOPS, pos)
                    self._text(buffer[pos:len(buffer) - keep], events)
                    pos = len(buffer) - keep
                    break
                at, tag = found
                self._text(buffer[pos:at], events)
                ending = tag in _ENDS
                self._current.end = tag if ending else None
                events.append(Event("close", self._current, tag if ending else ""))
                self._current, self._state = None, _AT_START
                pos = at + len(tag) if ending else at
        self._held = buffer[pos:]
        return events

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        events: list[Event] = []
        if held and self._state != _IN_BODY:
            self._open(Message(CONTENT), events)  # a header never finished: as it is
        self._text(held, events)
        return events

    def _header(self, buffer: str, pos: int, events: list[Event]) -> int:
        """In a header that starts at `pos`: opens its message once <|message|> is there
        (or a content message where it cannot be); returns where reading goes on."""
        found = None
        for tag in (MESSAGE, *_ENDS, START):
            # The header's own <|start|> does not count; a second one does.
            at = buffer.find(tag, pos + 1 if tag == START else pos)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, tag)
        if found is not None and found[0] - pos <= HEADER_LIMIT:
            at, tag = found
            if tag == MESSAGE:
                end = at + len(MESSAGE)
                self._open(_parse_header(buffer[pos:end]), events)
                return end
            self._open(Message(CONTENT), events)  # broken off: the text so far is content
            self._text(buffer[pos:at], events)
            return at
        if len(buffer) - pos >= HEADER_LIMIT + _LONGEST_TAG:
            # No tag can start within the limit any more: not a header (decided at the
            # same place however the text was cut).
            self._open(Message(CONTENT), events)
            self._text(buffer[pos:pos + HEADER_LIMIT + 1], events)
            return pos + HEADER_LIMIT + 1
        return pos

    def _open(self, message: Message, events: list[Event]) -> None:
        self.messages.append(message)
        self._current, self._state = message, _IN_BODY
        events.append(Event("open", message, message.header))

    def _text(self, piece: str, events: list[Event]) -> None:
        if piece:
            self._current.body += piece
            events.append(Event("text", self._current, piece))


def read(text: str) -> list[Message]:
    reader = HarmonyReader()
    reader.feed(text)
    reader.finish()
    return reader.messages


def _parse_header(header: str) -> Message:
    role_part, _, channel_part = header[:-len(MESSAGE)].removeprefix(START).partition(CHANNEL)
    role_words = role_part.split()
    # <|constrain|>json is the content type "json", as in `commentary json`.
    channel_words = channel_part.replace(CONSTRAIN, " ").split()
    recipient = next((w[3:] for w in role_words + channel_words if w.startswith("to=")), None)
    role = next((w for w in role_words if not w.startswith("to=")), None)
    rest = [w for w in channel_words if not w.startswith("to=")]
    channel = rest[0] if rest else None
    content_type = " ".join(rest[1:]) or None
    name = _function(recipient)
    if role not in (None, "assistant"):
        kind = DROPPED  # not the assistant's own message (vLLM skips those)
    elif name is not None:
        kind = TOOL_CALL
    elif channel == "analysis":
        kind = REASONING
    elif channel == "final" or recipient is None:
        kind = CONTENT  # the answer, a commentary preamble, or no known channel at all
    else:
        kind = DROPPED  # commentary to a built-in tool
    return Message(kind, header, name, content_type)


def _function(recipient: str | None) -> str | None:
    """vLLM's is_function_recipient for the chat route: `functions.NAME`, or any bare
    name but `assistant` and the built-in tools."""
    if not recipient or recipient.startswith("<|") or recipient == "assistant":
        return None
    if recipient.startswith("functions."):
        return recipient[len("functions."):] or None
    if recipient.split(".", 1)[0] in _BUILTIN_TOOLS:
        return None
    return recipient


def arguments(message: Message) -> str:
    """A whole call's arguments: JSON re-serialised (as vLLM does for a json or unnamed
    content type), any other text as the model wrote it."""
    if message.content_type is None or "json" in message.content_type:
        try:
            return arguments_json(json.loads(message.body))
        except (ValueError, RecursionError):
            pass
    return message.body


class OpenAIParser:
    """`--tool-call-parser openai`. Meant to run behind `--reasoning-parser openai_gptoss`
    (openai_frontend/reasoning.py), which passes a call's message on as it is and turns
    everything else into plain reasoning and content: the text here is then content, then
    the calls. The content the route streams is a prefix of the text, so without that
    parser a streamed answer's content would keep the tags; its calls are found either way.
    Content is the text before the first message header (vLLM streams no content after a
    call, and a call ends the turn: <|call|> is a stop token)."""
    # The harmony tags are special tokens of gpt-oss's tokenizer: the text must keep them.
    keeps_special_tokens = True

    def extract(self, text: str) -> Extracted:
        messages = read(text)
        calls = [ToolCall(m.name, arguments(m)) for m in messages if m.kind == TOOL_CALL]
        if not calls:
            return plain(text)
        return Extracted(calls, _leading_content(messages) or None)

    def scan(self, text: str, cache: ScanCache) -> Scan:
        reader: HarmonyReader = cache.get(("harmony",), HarmonyReader)
        reader.feed(text[reader.fed:])
        messages = reader.messages
        return Scan(len(_leading_content(messages)),
                    [ToolCall(m.name, m.body) for m in messages if m.kind == TOOL_CALL])


def _leading_content(messages: list[Message]) -> str:
    # Text outside any header at the very start: that is text[:len(body)], as it is.
    if messages and not messages[0].header and messages[0].kind == CONTENT:
        return messages[0].body
    return ""
