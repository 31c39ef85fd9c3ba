"""Prometheus text exposition -> families as a scraper sees them: the name and kind a
`# TYPE` line gives, the label names of its series, and its histogram bucket edges.
Reads Triton's /metrics and prometheus_client's generate_latest() alike, so a test can
hold one against the other."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_SAMPLE = re.compile(r'^(?P<name>[^\s{]+)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_SUFFIXES = ("", "_bucket", "_sum", "_count", "_created")


@dataclass
class ExposedFamily:
    name: str
    kind: str
    label_names: set[str] = field(default_factory=set)
    # The bucket edges (without +Inf) of each series, keyed by its labels but `le`.
    buckets: dict[tuple[tuple[str, str], ...], list[float]] = field(default_factory=dict)
    # Every sample: (sample name, labels) -> value.
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def value(self, suffix: str = "", **labels: str) -> float:
        """The sum over the series whose labels include `labels`."""
        return sum(v for (name, key), v in self.samples.items()
                   if name == self.name + suffix and labels.items() <= dict(key).items())


def parse_exposition(text: str) -> dict[str, ExposedFamily]:
    families: dict[str, ExposedFamily] = {}
    current: ExposedFamily | None = None
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            current = families.setdefault(name, ExposedFamily(name, kind.strip()))
            continue
        if not line.strip() or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None or current is None:
            raise ValueError(f"unparsable exposition line: {line!r}")
        sample = match["name"]
        base = _family_base(current.name, current.kind)
        if not any(sample == base + s for s in _SUFFIXES) and sample != current.name:
            raise ValueError(f"sample {sample} outside its family {current.name}")
        labels = dict(_LABEL.findall(match["labels"] or ""))
        le = labels.pop("le", None)
        key = tuple(sorted(labels.items()))
        current.label_names |= labels.keys()
        current.samples[(sample, key)] = current.samples.get((sample, key), 0.0) + float(match["value"])
        if sample.endswith("_bucket") and le is not None:
            edge = float(le)
            if not math.isinf(edge):
                current.buckets.setdefault(key, []).append(edge)
    return families


def _family_base(name: str, kind: str) -> str:
    # prometheus_client's counter family `x_total` also writes `x_created`.
    return name[:-len("_total")] if kind == "counter" and name.endswith("_total") else name
