"""KVEventsConfig: vLLM's KV-cache event settings (engine/core/kv_cache/publisher.py
publishes them)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config.json_section import section_from_value

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
        """vLLM's rule for data-parallel engines (ZmqEventPublisher.offset_endpoint_port),
        which Triton instances of one model are: rank N publishes on the configured TCP
        ports + N (port 0 stays 0, for the OS to pick; ipc/inproc get a `_dpN` suffix,
        where vLLM refuses ipc). Ranks 0..N all bind their pairs on one host, so a pair
        fewer than N + 1 ports apart collides; rank N finds that out here, before it
        binds anything, and says which ports (check_rank_ports)."""
        config = self if rank == 0 else dataclasses.replace(
            self, endpoint=_offset_endpoint(self.endpoint, rank),
            replay_endpoint=(_offset_endpoint(self.replay_endpoint, rank)
                             if self.replay_endpoint else None))
        self.check_rank_ports(rank)
        return config

    def check_rank_ports(self, rank: int) -> None:
        """Raises ValueError, naming the ports, if rank `rank` would bind an address that
        it or a lower rank binds too (each pair of ranks is checked by the higher one)."""
        if self.publisher == "null":
            return
        mine = self._bound(rank)
        for other in range(rank + 1):
            theirs = self._bound(other) if other != rank else mine
            for name, (key, address) in mine.items():
                for other_name, (other_key, other_address) in theirs.items():
                    if key != other_key or (other == rank and name >= other_name):
                        continue
                    whose = "its own" if other == rank else f"rank {other}'s"
                    if key.startswith("tcp:"):
                        clash = "port"
                        advice = ("so with N instances the two ports must be at least N apart, "
                                  f"e.g. endpoint {self.endpoint!r} with replay_endpoint "
                                  f"{_suggest_replay(self.endpoint, rank)!r}")
                    else:
                        clash = "address"
                        advice = ("ipc/inproc addresses get a _dpN suffix, so no address may be "
                                  "another's name plus such a suffix")
                    raise ValueError(
                        f"kv_events_config: instance rank {rank} would bind {name} {address}, "
                        f"the same {clash} as {whose} {other_name} {other_address}. Each "
                        "instance of a model (instance_group count N) publishes on endpoint "
                        "and replay_endpoint offset by its rank (vLLM's data-parallel rule), "
                        + advice)

    def _bound(self, rank: int) -> dict[str, tuple[str, str]]:
        """The addresses rank `rank` binds, each with what makes two of them clash: the
        TCP port whatever the host (a wildcard bind holds it on every interface), or the
        whole ipc/inproc address. A PUB endpoint with a host address is connected to,
        not bound; TCP port 0 is the OS's choice and never clashes."""
        out = {}
        for name, endpoint in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if not endpoint or (name == "endpoint" and not binds(endpoint)):
                continue
            address = endpoint if rank == 0 else _offset_endpoint(endpoint, rank)
            if address.startswith(("ipc://", "inproc://")):
                out[name] = (address, address)
                continue
            port = _tcp_port(address)
            if port:
                out[name] = (f"tcp:{port}", address)
        return out

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_value(cls, name: str, value: Any) -> "KVEventsConfig | None":
        """A mapping (model.json) or its JSON text (a config.pbtxt parameter, a CLI flag)."""
        return section_from_value(cls, name, value)


def binds(endpoint: str) -> bool:
    """vLLM's convention (ZmqEventPublisher._is_bind_endpoint): an address with a
    wildcard, or an ipc/inproc one, is bound; a host address is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _tcp_port(endpoint: str) -> int | None:
    head, sep, port = endpoint.rpartition(":")
    return int(port) if endpoint.startswith("tcp://") and sep and port.isdigit() else None


def _offset_endpoint(endpoint: str, rank: int) -> str:
    if rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    port = _tcp_port(endpoint)
    if port is not None:
        return endpoint if port == 0 else f"{endpoint.rpartition(':')[0]}:{port + rank}"
    raise ValueError(f"kv_events_config: cannot give rank {rank} its own endpoint from {endpoint!r}")


def _suggest_replay(endpoint: str, rank: int) -> str:
    """A replay endpoint 100 ports above the PUB one, as deploy/ and vLLM's own tests
    space them (no collision up to 100 instances), or further for more ranks."""
    step = 100 * ((rank + 1) // 100 + 1)
    port = _tcp_port(endpoint)
    return f"tcp://*:{(port or 5557) + step}"
