"""The chat route's reasoning parser (`--reasoning-parser`, vLLM's flag and names): what a
thinking model writes between <think> and </think> is returned as the message's
`reasoning_content`, the rest as its `content`, whole or streamed.

The rules are those of vLLM 0.32's deepseek_r1 and qwen3 parsers, on the text:
- Reasoning runs from the start of the output to the first </think>; the model may leave
  out the opening <think> (DeepSeek-R1's and Qwen3-thinking's templates write it into the
  prompt). <think> tags within it are dropped.
- What follows that </think> is content, as it is.
- No </think> at all (cut off by max_tokens, or a model that did not think): all of the
  text is reasoning and content is null.
- qwen3 only: <tool_call> ends reasoning too and stays in the content, where
  --tool-call-parser finds it; chat_template_kwargs {"enable_thinking": false} turns
  reasoning off, the whole text is content.
- A prompt that already closed reasoning (its last marker is </think>, as templates write
  when thinking is off; for qwen3, within the last turn) makes the whole text content.
- So does a constrained request (structured outputs, a named or "required" tool choice):
  this engine holds the output to the grammar from its first token, so it holds no
  reasoning (vLLM's engine, given its own reasoning_parser, starts the grammar after it).

Streamed, a tag split across Triton's chunks is held back until it is whole or cannot be
one, so no tag ever reaches either field, and the streamed pieces join to what the whole
answer holds. Where vLLM 0.32's own streamed and whole answers disagree, both follow its
streamed one (tests/conformance/test_reasoning_vllm.py): deepseek_r1 keeps text before a
late <think> as reasoning (vLLM's whole answer drops it), qwen3 leaves a second </think>
in the content (its whole answer drops it), and the prompt's closed reasoning counts for a
whole answer too (vLLM's whole answer does not look at the prompt).

openai_gptoss (gpt-oss) reads OpenAI's harmony messages instead of tags
(openai_frontend/tool_parsers/harmony.py): `analysis` messages are reasoning, `final` and
`commentary` preambles content, each field's messages joined by a newline (vLLM's whole
answer; its stream runs them together). A tool call's message stays in the content as the
model wrote it (ended by <|call|> if the next header ended it), where --tool-call-parser
openai finds it, as qwen3 leaves <tool_call>. No enable_thinking switch and no look at the
prompt: every harmony answer opens with its own channel header. A constrained request is
all content here too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from openai_frontend.tool_parsers import harmony
from openai_frontend.tool_parsers.base import earliest_tag, partial_tag_length

log = logging.getLogger("openai_frontend")

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
# Qwen3's chat-template turn markers: a reasoning end before the last one belongs to an
# earlier turn (vLLM's turn_boundary_tokens).
QWEN3_TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")


@dataclass(frozen=True, slots=True)
class _Grammar:
    # Tags that end reasoning and are dropped, and those that end it and stay in content.
    ends: tuple[str, ...] = (THINK_END,)
    ends_kept: tuple[str, ...] = ()
    # Markers that stop the look back through the prompt (nothing before them counts).
    boundaries: tuple[str, ...] = ()
    # Whether chat_template_kwargs' enable_thinking switches reasoning off.
    obeys_enable_thinking: bool = False
    # Tokens a model of this family has in its vocabulary.
    markers: ClassVar[tuple[str, ...]] = (THINK_START, THINK_END)

    @property
    def tags(self) -> tuple[str, ...]:
        return (THINK_START, *self.ends, *self.ends_kept)

    def closed_by(self, prompt: str) -> bool:
        return _prompt_closed_reasoning(self, prompt)

    def stream(self, thinking: bool) -> "ReasoningStream":
        return ReasoningStream(self, thinking)


@dataclass(frozen=True, slots=True)
class _Harmony:
    obeys_enable_thinking: ClassVar[bool] = False
    markers: ClassVar[tuple[str, ...]] = (harmony.CHANNEL, harmony.MESSAGE)
    tags: ClassVar[tuple[str, ...]] = harmony.TAGS

    def closed_by(self, prompt: str) -> bool:
        return False

    def stream(self, thinking: bool) -> "HarmonyStream":
        return HarmonyStream(thinking)


PARSERS: dict[str, _Grammar | _Harmony] = {
    "deepseek_r1": _Grammar(),
    "openai_gptoss": _Harmony(),
    "qwen3": _Grammar(ends_kept=(TOOL_CALL_START,), boundaries=QWEN3_TURN_BOUNDARIES,
                      obeys_enable_thinking=True),
}


def check_parser_name(name: str) -> None:
    """Raises ValueError naming the supported parsers (at startup, not per request)."""
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; supported: "
                         f"{', '.join(sorted(PARSERS))}")


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """The server's --reasoning-parser. `keeps_special_tokens`: the tags are special tokens
    of the served tokenizer, so the engine must be asked to keep them in the text (else
    detokenizing drops them and nothing could be split)."""
    name: str
    keeps_special_tokens: bool = False

    def __post_init__(self) -> None:
        check_parser_name(self.name)

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer: Any) -> "ReasoningParser":
        check_parser_name(name)
        grammar = PARSERS[name]
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        if any(marker not in vocab for marker in grammar.markers):
            # vLLM refuses such a tokenizer; the text is split here, so it still works for a
            # model that spells the tags out, but it is most likely the wrong model.
            log.warning("--reasoning-parser %s: the tokenizer has no %s token; is this a "
                        "reasoning model?", name, " / ".join(grammar.markers))
        return cls(name, bool(_special_tokens(tokenizer) & set(grammar.tags)))

    def plan(self, prompt: str, chat_template_kwargs: dict[str, Any] | None,
             constrained: bool = False) -> "ReasoningPlan":
        """How one chat request's output is read: `prompt` is the rendered chat prompt;
        `constrained`: the request carries structured outputs (response_format, a named or
        required tool choice), which this engine applies from the first token on (vLLM's
        engine would wait for the reasoning to end), so its text is all content."""
        grammar = PARSERS[self.name]
        kwargs = chat_template_kwargs or {}
        thinking = not (grammar.obeys_enable_thinking and not kwargs.get("enable_thinking", True))
        return ReasoningPlan(grammar, thinking and not constrained
                             and not grammar.closed_by(prompt))


@dataclass(frozen=True, slots=True)
class ReasoningPlan:
    """One request's reading. `thinking` false: the whole output is content."""
    grammar: _Grammar | _Harmony
    thinking: bool = True

    def stream(self) -> "ReasoningStream | HarmonyStream":
        return self.grammar.stream(self.thinking)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output, through the same stream a streamed answer
        uses, so the two always agree. Empty parts are None (vLLM's null), except that
        without thinking the text is the content as it is."""
        if not self.thinking:
            return None, text
        stream = self.stream()
        reasoning, content = stream.feed(text)
        tail_reasoning, tail_content = stream.finish()
        return (reasoning + tail_reasoning) or None, (content + tail_content) or None


class ReasoningStream:
    """Splits a choice's text as it arrives: feed(delta) -> (reasoning, content) released
    now; finish() releases what was held back (a partial tag at the very end)."""

    def __init__(self, grammar: _Grammar, thinking: bool = True) -> None:
        self._grammar = grammar
        self._in_reasoning = thinking
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self._in_reasoning:
            return "", text
        buffer, self._held = self._held + text, ""
        reasoning: list[str] = []
        pos = 0
        while True:
            found = earliest_tag(buffer, pos, self._grammar.tags)
            if found is None:
                break
            at, tag = found
            reasoning.append(buffer[pos:at])
            if tag == THINK_START:  # dropped; reasoning goes on
                pos = at + len(tag)
                continue
            self._in_reasoning = False
            # A dropped end tag goes; a kept one (qwen3's <tool_call>) opens the content.
            rest = buffer[at + len(tag):] if tag in self._grammar.ends else buffer[at:]
            return "".join(reasoning), rest
        tail = buffer[pos:]
        keep = partial_tag_length(tail, self._grammar.tags)
        self._held = tail[len(tail) - keep:] if keep else ""
        reasoning.append(tail[:len(tail) - keep])
        return "".join(reasoning), ""

    def finish(self) -> tuple[str, str]:
        # The output ended inside reasoning: a held-back "</thi" was reasoning after all.
        held, self._held = self._held, ""
        return held, ""


class HarmonyStream:
    """openai_gptoss's stream: the same feed / finish as ReasoningStream, over harmony
    messages (the reader holds back unfinished headers and tags)."""

    def __init__(self, thinking: bool = True) -> None:
        self._reader = harmony.HarmonyReader() if thinking else None
        # The message each field last took text from: a new one is set off by a newline.
        self._last: dict[str, harmony.Message] = {}

    def feed(self, text: str) -> tuple[str, str]:
        if self._reader is None:
            return "", text
        return self._route(self._reader.feed(text))

    def finish(self) -> tuple[str, str]:
        if self._reader is None:
            return "", ""
        return self._route(self._reader.finish())

    def _route(self, events: list[harmony.Event]) -> tuple[str, str]:
        parts: dict[str, list[str]] = {harmony.REASONING: [], harmony.CONTENT: []}
        for what, message, text in events:
            if message.kind == harmony.TOOL_CALL:
                # Passed on whole for the tool parser; a call the next header cut short is
                # ended with <|call|> so that its arguments stop there.
                parts[harmony.CONTENT].append(text if what != "close" else text or harmony.CALL)
            elif message.kind in parts and what == "text":
                last = self._last.get(message.kind)
                if last is not None and last is not message:
                    parts[message.kind].append("\n")
                self._last[message.kind] = message
                parts[message.kind].append(text)
        return "".join(parts[harmony.REASONING]), "".join(parts[harmony.CONTENT])


def _prompt_closed_reasoning(grammar: _Grammar, prompt: str) -> bool:
    """vLLM's is_reasoning_end on the prompt: the last marker decides; a turn boundary
    (qwen3) or no marker at all means the output starts in reasoning."""
    closing = (*grammar.ends, *grammar.ends_kept)
    last = max(((prompt.rfind(m), m) for m in (THINK_START, *closing, *grammar.boundaries)),
               key=lambda found: found[0])
    return last[0] >= 0 and last[1] in closing


def _special_tokens(tokenizer: Any) -> set[str]:
    special = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            special.add(str(token))
    return special
