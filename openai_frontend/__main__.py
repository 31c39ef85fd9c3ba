"""python -m openai_frontend: serve the OpenAI-compatible routes for a Triton `llm` model."""
from __future__ import annotations

import argparse
import logging

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
    parser.add_argument("--host", default="0.0.0.0", help="(default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="(default: %(default)s)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from openai_frontend.app import create_app
    from openai_frontend.chat import load_tokenizer

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tokenizer = load_tokenizer(args.tokenizer)
    app = create_app(args.triton_grpc, args.model, args.served_model_name or args.model, tokenizer)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
