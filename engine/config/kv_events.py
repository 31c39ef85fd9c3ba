"""KVEventsConfig: vLLM's KV-cache event settings (engine/core/kv_cache/publisher.py
publishes them)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any, Mapping

from engine.values import NULL_WORDS, convert

PUBLISHERS = ("null", "zmq")


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields and defaults."""
    enable_kv_cache_events: bool = False
    # None: "zmq" when events are on, else "null" (vLLM's rule).
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {PUBLISHERS}, "
                             f"got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"kv_events_config.{name} must be positive, got {getattr(self, name)}")

    def for_rank(self, rank: int) -> "KVEventsConfig":
        """vLLM's rule for data-parallel engines, which Triton instances of one model are:
        rank N publishes on the configured TCP ports + N (ipc/inproc: a `_dpN` suffix)."""
        if rank == 0:
            return self
        return dataclasses.replace(self, endpoint=_offset_endpoint(self.endpoint, rank),
                                   replay_endpoint=(_offset_endpoint(self.replay_endpoint, rank)
                                                    if self.replay_endpoint else None))

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_value(cls, name: str, value: Any) -> "KVEventsConfig | None":
        """A mapping (model.json) or its JSON text (a config.pbtxt parameter, a CLI flag)."""
        if value is None or isinstance(value, KVEventsConfig):
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


def _offset_endpoint(endpoint: str, rank: int) -> str:
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + rank}"
    raise ValueError(f"kv_events_config: cannot give rank {rank} its own endpoint from {endpoint!r}")
