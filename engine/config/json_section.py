"""A config section given as a JSON object: a mapping (LLM(...), model.json) or its JSON
text (a config.pbtxt parameter, a CLI flag), each key converted to its field's type."""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, Mapping, TypeVar

from engine.values import NULL_WORDS, convert

T = TypeVar("T")


def section_from_value(cls: type[T], name: str, value: Any) -> T | None:
    """None for None or a null word; an instance as it is; else `cls(**converted keys)`,
    refusing unknown keys and values that are not objects, naming `name`."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        if value.strip().lower() in NULL_WORDS:
            return None
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{name} must be a JSON object, got {value[:80]!r}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {unknown}; known: {sorted(known)}")
    return cls(**{key: convert(f"{name}.{key}", raw, str(known[key].type))
                  for key, raw in value.items()})
