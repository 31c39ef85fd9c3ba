"""Where a parsed JSON value is not Unicode text: JSON's `\\ud800` escape parses to a lone
surrogate in Python, which UTF-8 (gRPC, the tokenizer) cannot encode. One walk for the
Triton backend's parsers and the OpenAI route; iterative, so no nesting depth breaks it.
Pure stdlib."""
from __future__ import annotations

from typing import Any


def _unencodable(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return text[exc.start]
    return None


def find_lone_surrogate(value: Any) -> tuple[tuple[str | int, ...], bool, str] | None:
    """The first lone surrogate in document order, as (path, in_key, character): `path`
    names the string's place (dict keys and list indexes), ending in the key itself when
    `in_key` (the surrogate is in a dict key). None if there is none."""
    # (path, item, is the item a key); children pushed in reverse, so popped in order.
    stack: list[tuple[tuple[str | int, ...], Any, bool]] = [((), value, False)]
    while stack:
        path, item, is_key = stack.pop()
        if isinstance(item, str):
            bad = _unencodable(item)
            if bad is not None:
                return path, is_key, bad
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                stack.append((path + (key,), child, False))
                stack.append((path + (key,), key, True))
        elif isinstance(item, list):
            stack.extend((path + (index,), child, False)
                         for index, child in reversed(list(enumerate(item))))
    return None


def dotted(path: tuple[str | int, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
