"""pythonic (Llama 3.2 / 4 pythonic, ToolACE, ...): the reply is a Python list of calls,
`[get_weather(city="Paris"), add(a=1, b=2)]`, read with Python's `ast` (never evaluated):
keyword arguments with literal values only. JSON's true/false/null are read as Python's,
as vLLM does, since models write both."""
from __future__ import annotations

import ast
from typing import Any

from openai_frontend.tool_parsers.base import Extracted, Scan, ToolCall, arguments_json, plain

_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicParser:
    def extract(self, text: str) -> Extracted:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return plain(text)
            return Extracted([_call(node) for node in tree.elts], None)
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return plain(text)

    def scan(self, text: str) -> Scan:
        rest = text.lstrip()
        if not rest:
            return Scan(0)
        if not rest.startswith("["):
            return Scan(len(text))
        calls = []
        for segment in _finished_elements(rest):
            try:
                calls.append(_call(ast.parse(segment.strip(), mode="eval").body))
            except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
                break
        return Scan(0, calls)


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


def _finished_elements(text: str) -> list[str]:
    """The list's elements that are complete in `text` (which starts with `[`): each ends
    at a top-level `,` or at the closing `]`. Knows Python's quotes, so a bracket or comma
    inside a string does not count."""
    elements, depth, quote, escaped, begin = [], 0, "", False, 1
    for i, ch in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                elements.append(text[begin:i])
                return [e for e in elements if e.strip()]
        elif ch == "," and depth == 1:
            elements.append(text[begin:i])
            begin = i + 1
    return elements
