"""The offline loop LLM.generate, LLM.embed and LLM.score share: add every request, step
the engine until none is left, hand back each request's final output in the order the
requests were added."""
from __future__ import annotations

from typing import Any, Callable, Iterable

from tqdm.auto import tqdm


def run_to_completion(engine: Any, adds: Iterable[Callable[[], str]], desc: str,
                      use_tqdm: bool | None) -> list:
    """`adds`: one call per request, each adding it to `engine` and returning its id. A
    call that raises aborts the requests added before it (none stays queued) and the
    error goes to the caller."""
    ids: list[str] = []
    try:
        for add in adds:
            ids.append(add())
    except Exception:
        engine.abort_request(ids)
        raise
    results: dict[str, Any] = {}
    # A bar is noise for a handful of prompts.
    show = use_tqdm if use_tqdm is not None else len(ids) >= 8
    with tqdm(total=len(ids), desc=desc, unit="req", disable=not show) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
    return [results[rid] for rid in ids]
