"""The one converter from user-written values to typed ones.

config.pbtxt parameters and CLI flags arrive as strings, JSON sampling parameters as
strings or JSON values, request tensors as numpy scalars. Load time (EngineConfig,
backend options) and request time (sampling parameters, switches) all convert here, so
"off" or "1.5" means the same wherever a user writes it. Every error is a ValueError
that starts with the `name` the caller passes, so the user learns which value was bad.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Callable

import numpy as np

TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
FALSE_WORDS = frozenset({"false", "0", "no", "off"})
# Only for optional fields: these strings mean "not set".
NULL_WORDS = frozenset({"", "none", "null"})
# int() would also take "1_000" and other scripts' digits; a config value should not.
_INTEGER = re.compile(r"[+-]?[0-9]+")


def to_bool(name: str, value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ValueError(f"{name} must be a boolean (true/false, 1/0, yes/no, on/off), "
                     f"got {_shown(value)}")


def to_int(name: str, value: Any) -> int:
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    # JSON writers may send 3 as 3.0; 3.5 is still refused.
    if isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        try:
            return int(value.strip())
        except ValueError:  # past Python's 4300-digit limit
            pass
    raise ValueError(f"{name} must be an integer, got {_shown(value)}")


def to_float(name: str, value: Any) -> float:
    """Finite only: downstream math runs in float32, where inf and nan spread to every
    value they touch (a nan temperature turned a whole batch's logits into nan)."""
    number: float | None = None
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        try:
            number = float(value)
        except OverflowError:
            raise ValueError(f"{name} must be a finite number, got an integer too large "
                             "for a float") from None
    elif isinstance(value, str) and value.isascii() and "_" not in value:
        try:
            number = float(value.strip())
        except ValueError:
            pass
    if number is None:
        raise ValueError(f"{name} must be a number, got {_shown(value)}")
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {_shown(value)}")
    return number


def to_str(name: str, value: Any) -> str:
    """Surrounding whitespace is dropped: config.pbtxt values are often padded by hand."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        return value.strip()
    raise ValueError(f"{name} must be a string, got {_shown(value)}")


def to_list(name: str, value: Any) -> list:
    """A list, a string holding a JSON list ('["a","b"]', as string-only clients send
    it) or one plain string, taken whole: whitespace matters ("\\n" is a common stop)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except ValueError:  # bad JSON, or an integer past the 4300-digit limit
                raise ValueError(f"{name}: invalid JSON list {_shown(value)}") from None
        else:
            value = [value] if value else []
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list, got {_shown(value)}")
    return value


def to_str_list(name: str, value: Any) -> list[str]:
    items = to_list(name, value)
    if not all(isinstance(item, str) for item in items):
        raise ValueError(f"{name} must be a list of strings, got {_shown(value)}")
    return items


def to_int_list(name: str, value: Any) -> list[int]:
    return [to_int(name, item) for item in to_list(name, value)]


def to_float_dict(name: str, value: Any) -> dict[str, float]:
    """A {name: number} mapping, or a string holding one as JSON (config.pbtxt)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{name}: invalid JSON object {_shown(value)}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{name} must be an object of names to numbers, got {_shown(value)}")
    return {key: to_float(f"{name}[{key!r}]", item) for key, item in value.items()}


def to_int_lists(name: str, value: Any) -> list[list[int]]:
    """A list of id lists (stop_token_sequences), or its JSON text."""
    items = to_list(name, value)
    if not all(isinstance(item, list) for item in items):
        raise ValueError(f"{name} must be a list of integer lists, got {_shown(value)}")
    return [to_int_list(name, item) for item in items]


_BY_KIND: dict[str, Callable[[str, Any], Any]] = {
    "bool": to_bool, "int": to_int, "float": to_float, "str": to_str,
    "list[str]": to_str_list, "list[int]": to_int_list, "list[list[int]]": to_int_lists,
    "dict[str, float]": to_float_dict,
}


def convert(name: str, value: Any, kind: str) -> Any:
    """`value` as the annotation `kind` says: "int", "float | None", "list[str]", ...
    (a dataclass field's type, which stays a string under postponed annotations)."""
    parts = [part.strip() for part in kind.split("|")]
    optional = "None" in parts
    parts = [part for part in parts if part != "None"]
    if len(parts) != 1 or parts[0] not in _BY_KIND:
        raise TypeError(f"{name}: no conversion to {kind!r}")
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in NULL_WORDS):
        if optional:
            return None
        raise ValueError(f"{name} must not be null")
    return _BY_KIND[parts[0]](name, value)


def _shown(value: Any) -> str:
    # Error messages go back to clients and logs: bound what a huge value adds.
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit str() limit
        return f"a {type(value).__name__} too large to print"
    return text if len(text) <= 80 else text[:77] + "..."
