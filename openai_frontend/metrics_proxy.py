"""/metrics on the OpenAI route's port: Triton's metrics endpoint, passed through as it
is (Prometheus text, Triton's content type), then the route's own counters. An endpoint
picker or a pod-level scrape pointed at the serving port finds the `llm` model's vllm:*
families there."""
from __future__ import annotations

from collections import Counter

import aiohttp
from starlette.responses import Response

from openai_frontend.errors import APIError

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


class RouteMetrics:
    """The route's own counters, in Prometheus' text format (two counters do not need
    prometheus_client, which the route does not otherwise depend on)."""

    CANCELLED = "openai_frontend:requests_cancelled_total"
    REFUSED = "openai_frontend:connections_refused_total"
    REASONS = ("client_disconnected", "stream_not_read")

    def __init__(self) -> None:
        self.cancelled: Counter[str] = Counter()
        self.refused_connections = 0

    def text(self) -> str:
        lines = [f"# HELP {self.CANCELLED} Requests the route cancelled on Triton: the client "
                 "left before its answer (client_disconnected), or stopped reading its stream "
                 "for --stream-idle-timeout (stream_not_read).",
                 f"# TYPE {self.CANCELLED} counter"]
        lines += [f'{self.CANCELLED}{{reason="{r}"}} {self.cancelled[r]}' for r in self.REASONS]
        lines += [f"# HELP {self.REFUSED} Connections answered 503 and closed at once: "
                  "--max-connections were open.",
                  f"# TYPE {self.REFUSED} counter", f"{self.REFUSED} {self.refused_connections}"]
        return "\n".join(lines) + "\n"


async def triton_metrics(session: aiohttp.ClientSession, url: str) -> tuple[bytes, str]:
    try:
        async with session.get(url) as reply:
            body = await reply.read()
            if reply.status != 200:
                raise APIError(502, f"Triton's metrics endpoint {url} answered {reply.status}",
                               code="bad_gateway")
            media_type = reply.headers.get("Content-Type", TEXT_FORMAT)
    except aiohttp.ClientError as exc:
        raise APIError(503, f"Triton's metrics endpoint {url} is unreachable: {exc}",
                       code="service_unavailable") from None
    return body, media_type


async def metrics_response(session: aiohttp.ClientSession, url: str | None,
                           ours: RouteMetrics) -> Response:
    body, media_type = (await triton_metrics(session, url)) if url else (b"", TEXT_FORMAT)
    if body and not body.endswith(b"\n"):
        body += b"\n"
    return Response(body + ours.text().encode(), media_type=media_type)
