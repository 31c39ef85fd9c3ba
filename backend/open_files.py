"""The process's open-file limit, raised for servers: each client connection holds a
descriptor. Used by scripts/serve.py (for tritonserver, which inherits it) and the OpenAI
route. Pure stdlib."""
from __future__ import annotations

import resource


def raise_open_file_limit(wanted: int | None = None) -> tuple[int, int]:
    """The soft RLIMIT_NOFILE raised to `wanted` (None: the hard limit), never past the
    hard limit; (before, after). Where it cannot be raised, after == before."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if wanted is None else (wanted if hard == resource.RLIM_INFINITY
                                          else min(wanted, hard))
    if soft == resource.RLIM_INFINITY or target == resource.RLIM_INFINITY or target <= soft:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, target
