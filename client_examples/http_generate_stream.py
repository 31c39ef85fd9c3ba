"""Triton HTTP generate client for the `llm` model.

By default uses POST /v2/models/<model>/generate_stream and prints each Server-Sent Event's
text delta as it arrives; --no-stream uses /generate and prints the whole reply.

  python client_examples/http_generate_stream.py --prompt "The capital of France is"
  python client_examples/http_generate_stream.py --chat --prompt "Tell me a joke" --no-stream
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import requests

if __package__ in (None, ""):  # run as `python client_examples/http_generate_stream.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client_examples.common import (  # noqa: E402
    DEFAULT_SYSTEM_PROMPT, ChatMessage, format_chatml, generate_request_body, iter_sse_data, sampling_parameters,
)


class GenerateError(RuntimeError):
    pass


def stream_generate(base_url: str, model: str, body: dict, out=None, timeout_s: float = 600.0) -> dict:
    """Print deltas as they arrive; returns the last event (which carries finish_reason etc.)
    with num_output_tokens summed over the stream (each event counts its own new tokens)."""
    out = out or sys.stdout
    url = f"{base_url}/v2/models/{model}/generate_stream"
    last: dict = {}
    num_output_tokens = 0
    with requests.post(url, json=body, stream=True, timeout=timeout_s) as resp:
        if resp.status_code != 200:
            raise GenerateError(f"HTTP {resp.status_code}: {resp.text.strip()}")
        for event in iter_sse_data(resp.iter_lines()):
            if "error" in event:
                raise GenerateError(event["error"])
            out.write(event.get("text_output", ""))
            out.flush()
            count = event.get("num_output_tokens", 0) or 0
            num_output_tokens += int(count[0] if isinstance(count, list) else count)
            last = event
    out.write("\n")
    if "num_output_tokens" in last:
        last = {**last, "num_output_tokens": num_output_tokens}
    return last


def generate(base_url: str, model: str, body: dict, out=None, timeout_s: float = 600.0) -> dict:
    out = out or sys.stdout
    resp = requests.post(f"{base_url}/v2/models/{model}/generate", json=body, timeout=timeout_s)
    payload = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
    if resp.status_code != 200 or "error" in payload:
        raise GenerateError(f"HTTP {resp.status_code}: {payload.get('error', resp.text.strip())}")
    out.write(payload.get("text_output", "") + "\n")
    return payload


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://localhost:8000", help="Triton HTTP base URL")
    p.add_argument("--model", default="llm")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a ChatML user turn")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-stream", action="store_true", help="use /generate (one response)")
    p.add_argument("--include-prompt", action="store_true",
                   help="non-streaming only: ask the server to prepend the prompt to the output")
    args = p.parse_args(argv)
    if args.include_prompt and not args.no_stream:
        p.error("--include-prompt needs --no-stream (streaming deltas never include the prompt)")

    prompt = args.prompt
    if args.chat:
        prompt = format_chatml([ChatMessage("system", DEFAULT_SYSTEM_PROMPT), ChatMessage("user", prompt)])
    body = generate_request_body(prompt, sampling_parameters(args.max_tokens, args.temperature),
                                 stream=not args.no_stream, exclude_input_in_output=not args.include_prompt)
    base = args.url.rstrip("/")
    if "://" not in base:
        base = "http://" + base
    start = time.perf_counter()
    try:
        final = (generate if args.no_stream else stream_generate)(base, args.model, body)
    except (GenerateError, requests.RequestException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    stats = {k: final[k] for k in ("finish_reason", "num_input_tokens", "num_output_tokens") if k in final}
    print(f"[{time.perf_counter() - start:.2f}s {stats}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
