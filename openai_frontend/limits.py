"""The route guarding itself against one careless client (issue 43): a bounded request
body, and a request whose client has left cancelled rather than run to the end.

Both are plain ASGI, below FastAPI: the body limit has to act before anything holds the
body, and a disconnect is only seen on the ASGI `receive` channel."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Awaitable, TypeVar

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openai_frontend.errors import APIError

T = TypeVar("T")

# A body over the limit is still read (and thrown away, chunk by chunk) up to this many
# bytes before the 413: a server that closes a socket with unread data in it makes the
# kernel send a reset, and the client sees "connection reset" instead of the 413.
DRAIN_LIMIT = 64 * 1024 * 1024
# Past this long without a byte of the body, draining stops and the connection closes.
DRAIN_IDLE_S = 10.0


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body larger than {limit} bytes (--max-request-bytes)",
                    code="request_too_large")


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Answers 413 to a body over `limit` bytes: at once when Content-Length says so,
    else as soon as the count passes it. The app never sees more than `limit` bytes."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await self._refuse(receive, send, drain=declared <= DRAIN_LIMIT)
            return
        received = 0
        exceeded = False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    exceeded = True
                    raise _BodyTooLarge()
            return message

        async def quiet_send(message: Message) -> None:
            if not exceeded:  # the app's answer to the interrupted read is replaced
                await send(message)

        try:
            await self.app(scope, counting_receive, quiet_send)
        except _BodyTooLarge:
            pass
        if exceeded:
            await self._refuse(receive, send, drain=True)

    async def _refuse(self, receive: Receive, send: Send, drain: bool) -> None:
        if drain:
            await _drain(receive)
        error = too_large(self.limit)
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _drain(receive: Receive) -> None:
    drained = 0
    with contextlib.suppress(asyncio.TimeoutError):
        while drained <= DRAIN_LIMIT:
            message = await asyncio.wait_for(receive(), DRAIN_IDLE_S)
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody reads the response."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone as soon as the client disconnects, with `work`
    cancelled (its Triton requests with it). The body has been read by then, so the next
    ASGI message is the disconnect, if it ever comes."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (shutdown)
        left = watcher.done() and not watcher.cancelled()
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if left and task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
