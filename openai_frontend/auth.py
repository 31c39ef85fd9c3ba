"""--api-key: requests under /v1 need `Authorization: Bearer <one of the keys>`.

vLLM's rule (vllm/entrypoints/serve/middleware/authenticate.py, 0.32) guards only the /v1
prefix; here /tokenize and /detokenize are guarded too (stricter than vLLM: they run the
tokenizer on whatever a client sends, CPU seconds for a large body), /score, /rerank and
/v2/rerank (they run the model, as /v1's routes do; vLLM 0.32 leaves them open), and
/tokenizer_info (it shows the chat template, which a deployment may keep to itself), while /health,
/metrics and /version stay open, and OPTIONS (CORS preflight) always passes. vLLM answers
{"error": "Unauthorized"}; here the 401 is an OpenAI error object, which the openai
client raises as AuthenticationError. Keys are compared by digest in constant time."""
from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from openai_frontend.errors import APIError

# "/tokenize" is a prefix of "/tokenizer_info" too; named anyway, so that guard never
# hangs on the spelling of another route.
GUARDED_PREFIXES = ("/v1", "/v2/rerank", "/score", "/rerank", "/tokenize", "/detokenize",
                    "/tokenizer_info")
ENV_VAR = "VLLM_API_KEY"


def api_keys(flag: list[str] | None, environ: dict[str, str]) -> tuple[str, ...]:
    """The keys in force: --api-key wins over VLLM_API_KEY (as vLLM); none: no check."""
    return tuple(k for k in (flag or [environ.get(ENV_VAR, "")]) if k)


def unauthorized() -> APIError:
    return APIError(401, "Unauthorized: send a valid API key as `Authorization: Bearer <key>`",
                    code="invalid_api_key")


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        # Every key compared, so the time taken says nothing about which one was close.
        return sum(hmac.compare_digest(digest, d) for d in self._digests) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path.startswith(GUARDED_PREFIXES) and not self._authorized(Headers(scope=scope)):
                error = unauthorized()
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
