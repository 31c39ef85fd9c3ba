"""/metrics on the OpenAI route's port: Triton's metrics endpoint, passed through as it
is (Prometheus text, Triton's content type). An endpoint picker or a pod-level scrape
pointed at the serving port finds the `llm` model's vllm:* families there."""
from __future__ import annotations

import aiohttp
from starlette.responses import Response

from openai_frontend.errors import APIError


async def triton_metrics(session: aiohttp.ClientSession, url: str) -> Response:
    try:
        async with session.get(url) as reply:
            body = await reply.read()
            if reply.status != 200:
                raise APIError(502, f"Triton's metrics endpoint {url} answered {reply.status}",
                               code="bad_gateway")
            media_type = reply.headers.get("Content-Type", "text/plain; version=0.0.4")
    except aiohttp.ClientError as exc:
        raise APIError(503, f"Triton's metrics endpoint {url} is unreachable: {exc}",
                       code="service_unavailable") from None
    return Response(body, media_type=media_type)
