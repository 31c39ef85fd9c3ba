"""pythonic (Llama 3.2 / 4 pythonic, ToolACE, ...): the reply is a Python list of calls,
`[get_weather(city="Paris"), add(a=1, b=2)]`, read with Python's `ast` (never evaluated):
keyword arguments with literal values only. JSON's true/false/null are read as Python's,
as vLLM does, since models write both."""
from __future__ import annotations

import ast
from typing import Any

from openai_frontend.tool_parsers.base import Extracted, Scan, ToolCall, arguments_json, plain
from openai_frontend.tool_parsers.json_calls import ScanCache

_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicParser:
    keeps_special_tokens = False

    def extract(self, text: str) -> Extracted:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return plain(text)
            return Extracted([_call(node) for node in tree.elts], None)
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return plain(text)

    def scan(self, text: str, cache: ScanCache) -> Scan:
        rest = text.lstrip()
        if not rest:
            return Scan(0)
        if not rest.startswith("["):
            return Scan(len(text))
        elements = cache.get(("pythonic",), lambda: _ListElements(len(text) - len(rest)))
        return Scan(0, elements.advance(text))


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("each element must be a call with keyword arguments only")
    name = _dotted(node.func)
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError("**kwargs is not a literal argument")
        arguments[keyword.arg] = _literal(keyword.value)
    return ToolCall(name, arguments_json(arguments))


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ValueError("a call's function must be a name")


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    return ast.literal_eval(node)


class _ListElements:
    """The list's calls complete so far (the text at `start` is `[`): an element ends at a
    top-level `,` or at the closing `]`, each read once. Knows Python's quotes, so a
    bracket or comma inside a string does not count. An element that is not a call ends
    the list: what follows is not announced."""

    def __init__(self, start: int) -> None:
        self.position = start
        self.calls: list[ToolCall] = []
        self.done = False
        self._depth, self._quote, self._escaped, self._begin = 0, "", False, start + 1

    def advance(self, text: str) -> list[ToolCall]:
        while not self.done and self.position < len(text):
            i, ch = self.position, text[self.position]
            self.position += 1
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == self._quote:
                    self._quote = ""
            elif ch in "'\"":
                self._quote = ch
            elif ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    self._element(text[self._begin:i])
                    self.done = True
            elif ch == "," and self._depth == 1:
                self._element(text[self._begin:i])
                self._begin = i + 1
        return self.calls

    def _element(self, segment: str) -> None:
        if not segment.strip():
            return
        try:
            self.calls.append(_call(ast.parse(segment.strip(), mode="eval").body))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            self.done = True
