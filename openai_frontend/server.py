"""uvicorn, set up so that many connections cannot take the route down (issue 43):
connections past --max-connections are answered 503 and closed at once (before they
hold a descriptor for long), a connection that has not sent a whole request head within
--header-timeout is closed (uvicorn itself only times out idle keep-alive connections),
in-flight requests are cancelled --graceful-shutdown-timeout after SIGTERM, and repeated
warnings and tracebacks are logged a few times per minute, not once per event."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from backend.open_files import raise_open_file_limit

log = logging.getLogger("openai_frontend")

# Descriptors the route needs beyond its client connections: the gRPC channel, the
# metrics session, the tokenizer's files, logs.
RESERVED_FDS = 64


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_connections: int = 2048
    header_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    graceful_shutdown_timeout: float = 5.0


def _refusal() -> bytes:
    body = json.dumps({"error": {
        "message": "too many connections: the server is at --max-connections; retry later",
        "type": "service_unavailable_error", "param": None,
        "code": "service_unavailable"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"connection: close\r\nretry-after: 1\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def guarded_protocol(limits: ServerLimits, on_refused: Callable[[], None] = lambda: None):
    """uvicorn's h11 protocol with a connection cap and a request-head timeout."""
    refusal = _refusal()

    class GuardedH11Protocol(H11Protocol):
        _refused = False
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= limits.max_connections:
                self._refused = True
                self.transport = transport
                on_refused()
                transport.write(refusal)
                transport.close()
                return
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._disarm_head_timer()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self._head_timer = self.loop.call_later(limits.header_timeout, self._head_deadline,
                                                    self.cycle)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_deadline(self, cycle_when_armed: Any) -> None:
            """Closes the connection if no request head has arrived since the timer was
            armed (a new request replaces self.cycle)."""
            self._head_timer = None
            if self.transport.is_closing() or self.cycle is not cycle_when_armed:
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    return GuardedH11Protocol


class RepeatFilter(logging.Filter):
    """Passes at most `burst` WARNING-or-worse records of one kind (logger, message
    template, exception type) per `window` seconds; the next one that passes says how
    many were dropped. INFO and below pass untouched (the access log)."""

    def __init__(self, burst: int = 5, window: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self.clock = clock
        self._seen: dict[tuple, list] = {}  # kind -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        exc_type = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        kind = (record.name, str(record.msg)[:200], exc_type)
        now = self.clock()
        state = self._seen.get(kind)
        if state is None or now - state[0] >= self.window:
            dropped = state[2] if state else 0
            if len(self._seen) > 1000:  # many kinds: forget them rather than grow
                self._seen.clear()
            self._seen[kind] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} [{dropped} more like this dropped in the last " \
                             f"{self.window:g} s]"
            return True
        if state[1] < self.burst:
            state[1] += 1
            return True
        state[2] += 1
        return False


def install_repeat_filter(repeat_filter: logging.Filter,
                          names: tuple[str, ...] = ("", "uvicorn", "uvicorn.error",
                                                    "uvicorn.access", "asyncio")) -> None:
    """On every handler those loggers write through (uvicorn configures its own)."""
    for name in names:
        for handler in logging.getLogger(name).handlers:
            if repeat_filter not in handler.filters:
                handler.addFilter(repeat_filter)


def server_config(app: Any, host: str, port: int, log_level: str, limits: ServerLimits,
                  on_refused: Callable[[], None] = lambda: None):
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        http=guarded_protocol(limits, on_refused),
        timeout_keep_alive=limits.keep_alive_timeout,
        timeout_graceful_shutdown=limits.graceful_shutdown_timeout,
        # h11's own bound on a request head (16 KiB), stated: a longer head is a 400.
        h11_max_incomplete_event_size=16 * 1024)


def serve(app: Any, host: str, port: int, log_level: str, limits: ServerLimits,
          on_refused: Callable[[], None] = lambda: None) -> None:
    import uvicorn

    _, soft = raise_open_file_limit(limits.max_connections + RESERVED_FDS)
    if soft < limits.max_connections + RESERVED_FDS:
        capped = max(1, soft - RESERVED_FDS)
        log.warning("--max-connections %d lowered to %d: the open-files limit is %d",
                    limits.max_connections, capped, soft)
        limits = ServerLimits(capped, limits.header_timeout, limits.keep_alive_timeout,
                              limits.graceful_shutdown_timeout)
    config = server_config(app, host, port, log_level, limits, on_refused)
    install_repeat_filter(RepeatFilter())
    uvicorn.Server(config).run()
