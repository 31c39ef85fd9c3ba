"""python -m openai_frontend: serve the OpenAI-compatible routes for a Triton `llm` model."""
from __future__ import annotations

import argparse
import logging
import os
from typing import Mapping

from openai_frontend.options import FrontendOptions
from openai_frontend.reasoning import PARSERS as REASONING_PARSERS
from openai_frontend.tool_parsers import PARSERS

DEFAULT_PORT = 9000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m openai_frontend",
        description="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health) forwarding to a Triton `llm` model over gRPC.")
    parser.add_argument("--triton-grpc", default="localhost:8001",
                        help="Triton's gRPC address (default: %(default)s)")
    parser.add_argument("--model", default="llm", help="the Triton model (default: %(default)s)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as `model` (default: --model)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder for the chat template (default: the embedded "
                             "SmolLM2-135M-Instruct's, the engine's default model)")
    parser.add_argument("--triton-metrics", default="http://localhost:8002/metrics",
                        help="Triton's metrics URL, re-exported at /metrics on this port "
                             "('' for none; default: %(default)s)")
    parser.add_argument("--api-key", nargs="+", default=None,
                        help="require `Authorization: Bearer <key>` on /v1 (one of these keys; "
                             "default: $VLLM_API_KEY, else no check)")
    parser.add_argument("--triton-admin-key", default=None, metavar="KEY",
                        help="sent as Triton's `admin-key` header on the model-config call "
                             "when Triton runs with serve.py --restrict-api "
                             "(default: $TRITON_ADMIN_KEY)")
    parser.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                        help="how the model writes tool calls (vLLM's parser names)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="tool_choice=auto: find calls in the text with --tool-call-parser")
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="split a thinking model's reasoning into the message's "
                             "reasoning_content: <think>...</think> (qwen3, deepseek_r1) or "
                             "gpt-oss's harmony analysis channel (openai_gptoss); vLLM's names")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters served as model ids (vLLM's flag: name=path or "
                             "JSON); each name must be one of the Triton model's "
                             "multi_lora.json adapters")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="reported by /tokenize (default: the limit the `llm` model "
                             "enforces, asked of it)")
    parser.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens "
                             "found in the prefix cache (vLLM's flag; default: on)")
    parser.add_argument("--enable-tokenizer-info-endpoint",
                        action=argparse.BooleanOptionalAction, default=False,
                        help="serve GET /tokenizer_info, the tokenizer's configuration and "
                             "chat template (vLLM's flag; default: off)")
    limits = parser.add_argument_group("protection against careless clients")
    limits.add_argument("--max-sequences-per-request", type=_positive(int), default=256,
                        metavar="N", help="prompts x n of one request (a completions batch); "
                                          "more is a 400 (default: %(default)s)")
    limits.add_argument("--max-request-bytes", type=_positive(int), default=4 * 1024 * 1024,
                        metavar="BYTES", help="a larger request body is a 413, refused before "
                                              "it is held in memory (default: %(default)s, 4 MiB)")
    limits.add_argument("--stream-idle-timeout", type=_seconds, default=30.0, metavar="S",
                        help="a stream whose client has not read an event for S seconds is "
                             "cancelled on Triton; 0: never (default: %(default)s)")
    limits.add_argument("--max-connections", type=_positive(int), default=2048, metavar="N",
                        help="open connections; one more is answered 503 and closed "
                             "(default: %(default)s)")
    limits.add_argument("--header-timeout", type=_positive(float), default=10.0, metavar="S",
                        help="a connection that has not sent a whole request head in S "
                             "seconds is closed (default: %(default)s)")
    limits.add_argument("--timeout-keep-alive", type=_positive(float), default=5.0, metavar="S",
                        help="an idle keep-alive connection is closed after S seconds "
                             "(uvicorn's; default: %(default)s)")
    limits.add_argument("--graceful-shutdown-timeout", type=_seconds, default=5.0, metavar="S",
                        help="on SIGTERM, requests still running after S seconds are "
                             "cancelled (default: %(default)s)")
    parser.add_argument("--host", default="0.0.0.0", help="(default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="(default: %(default)s)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    from openai_frontend.lora_modules import parse_lora_modules
    try:
        args.lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def server_limits(args: argparse.Namespace):
    from openai_frontend.server import ServerLimits

    return ServerLimits(args.max_connections, args.header_timeout, args.timeout_keep_alive,
                        args.graceful_shutdown_timeout)


def frontend_options(args: argparse.Namespace,
                     environ: Mapping[str, str] = os.environ) -> FrontendOptions:
    from backend.restricted_api import read_key
    from openai_frontend.auth import api_keys
    from openai_frontend.runtime_lora import runtime_updating
    from openai_frontend.tool_calls import ToolCallConfig

    return FrontendOptions(
        api_keys=api_keys(args.api_key, dict(environ)),
        triton_admin_key=read_key(args.triton_admin_key, None, environ, "--triton-admin-key"),
        tool_calls=ToolCallConfig(args.tool_call_parser, args.enable_auto_tool_choice),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        triton_metrics_url=args.triton_metrics or None, max_model_len=args.max_model_len,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        tokenizer_info=args.enable_tokenizer_info_endpoint,
        lora_modules=tuple(getattr(args, "lora_modules", None) or ()),
        runtime_lora_updating=runtime_updating(environ),
        max_sequences_per_request=args.max_sequences_per_request,
        max_request_bytes=args.max_request_bytes,
        stream_idle_timeout=args.stream_idle_timeout or None)


def main(argv: list[str] | None = None) -> None:
    from openai_frontend.app import create_app
    from openai_frontend.chat import load_tokenizer
    from openai_frontend.server import serve

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        options = frontend_options(args)
    except ValueError as exc:  # a bad key from the environment: say which, not a traceback
        raise SystemExit(f"openai_frontend: {exc}") from None
    tokenizer = load_tokenizer(args.tokenizer)
    app = create_app(args.triton_grpc, args.model, args.served_model_name or args.model, tokenizer,
                     options)
    metrics = app.state.route_metrics

    def refused() -> None:
        metrics.refused_connections += 1

    serve(app, args.host, args.port, args.log_level, server_limits(args), refused)


if __name__ == "__main__":
    main()
