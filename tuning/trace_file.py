"""Reading a trace written by engine/metrics/trace.py (the rotated `<path>.1` first, if any)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class Trace:
    header: dict[str, Any]
    requests: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)

    @property
    def engine_args(self) -> dict[str, Any]:
        return self.header.get("engine_args", {})


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    parts = [p for p in (path.with_name(path.name + ".1"), path) if p.exists()]
    if not parts:
        raise FileNotFoundError(f"no trace at {path}")
    trace = None
    for part in parts:
        with open(part, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if part == path and not line.endswith("\n"):
                    break  # a live trace's last line may be half written
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:  # a crash may cut the last line
                    raise ValueError(f"{part}:{number}: not a JSON line ({exc})") from None
                kind = record.get("type")
                if kind == "header":
                    trace = trace or Trace(record)
                elif trace is None:
                    raise ValueError(f"{part}: records before the header")
                elif kind == "request":
                    trace.requests.append(record)
                elif kind == "step":
                    trace.steps.append(record)
    if trace is None:
        raise ValueError(f"{path}: no header yet")
    trace.requests.sort(key=lambda r: r["arrival"])
    trace.steps.sort(key=lambda s: s["start"])
    return trace
