"""Triton's admin APIs behind a header key (serve.py --restrict-api, the deploy manifests).

tritonserver leaves every API open to whoever reaches its ports: anyone could unload
`llm`, load another model from the repository, read its config or map shared memory.
With a key, these need the header `admin-key: <key>` on HTTP, and on gRPC the metadata
`triton-grpc-protocol-admin-key: <key>` (tritonserver 2.51 prefixes the name it checks);
inference, health and metadata stay open for clients and probes. trace and logging are
restricted too: a verbose log level would write every client's prompt to the log.
Pure stdlib: scripts/serve.py and the OpenAI frontend read it before heavy imports."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

RESTRICTED_APIS = ("model-repository", "model-config", "shared-memory", "trace", "logging")
# Lowercase: gRPC metadata keys must be.
HEADER = "admin-key"
GRPC_HEADER = f"triton-grpc-protocol-{HEADER}"
ENV_VAR = "TRITON_ADMIN_KEY"
# Triton splits its flag at ':' and '=' and lists at ','; a header value cannot hold
# whitespace or control characters. Hex and base64 keys fit.
_KEY = re.compile(r"[A-Za-z0-9._~+/-]+")
MIN_KEY_LENGTH = 16


def check_key(key: str, source: str) -> str:
    """The key, or ValueError naming where it came from (`source`)."""
    if not _KEY.fullmatch(key):
        raise ValueError(f"{source}: the key may hold only letters, digits and . _ ~ + / -")
    if len(key) < MIN_KEY_LENGTH:
        raise ValueError(f"{source}: the key needs at least {MIN_KEY_LENGTH} characters "
                         "(e.g. openssl rand -hex 32)")
    return key


def read_key(flag: str | None, path: Path | None, environ: Mapping[str, str] = os.environ,
             flag_name: str = "--restrict-api") -> str | None:
    """The key from the flag, else the file (its text, surrounding whitespace dropped, as
    a mounted Secret or `echo KEY > file` leaves it), else $TRITON_ADMIN_KEY; None: no key."""
    if flag is not None and path is not None:
        raise ValueError(f"give {flag_name} or {flag_name}-file, not both")
    if flag is not None:
        return check_key(flag, flag_name)
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{flag_name}-file {path}: cannot read it ({exc})") from None
        return check_key(text, f"{flag_name}-file {path}")
    if environ.get(ENV_VAR):
        return check_key(environ[ENV_VAR], f"${ENV_VAR}")
    return None


def tritonserver_flags(key: str) -> list[str]:
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{HEADER}={key}",
            f"--grpc-restricted-protocol={apis}:{HEADER}={key}"]


def http_headers(key: str | None) -> dict[str, str] | None:
    """What an HTTP client of the restricted APIs sends (tritonclient's `headers=`)."""
    return {HEADER: key} if key else None


def grpc_headers(key: str | None) -> dict[str, str] | None:
    """The same for a gRPC client."""
    return {GRPC_HEADER: key} if key else None
