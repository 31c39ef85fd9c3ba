"""Serve model_repository with the tritonserver from the nvidia-pytriton wheel.

    scripts/serve.sh [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
                     [--host 127.0.0.1] [--model PATH] [--param KEY=VALUE ...]
                     [--load-model llm ...]

Ports and host may also come from TRITON_HTTP_PORT / TRITON_GRPC_PORT /
TRITON_METRICS_PORT / TRITON_HOST. --model and --param override the engine models'
config.pbtxt parameters in a copy of the repository under .triton/.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.repository_layout import copy_repository  # noqa: E402
from backend.triton_server import REPO_ROOT, ServerPorts, TritonServer, prepare_server_dir  # noqa: E402

ENGINE_MODELS = ("llm", "tensorrt_llm")
TOKENIZER_MODELS = ("preprocessing", "postprocessing")


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=env("TRITON_HOST", "127.0.0.1"))
    p.add_argument("--http-port", type=int, default=int(env("TRITON_HTTP_PORT", "8000")))
    p.add_argument("--grpc-port", type=int, default=int(env("TRITON_GRPC_PORT", "8001")))
    p.add_argument("--metrics-port", type=int, default=int(env("TRITON_METRICS_PORT", "8002")))
    p.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    p.add_argument("--model", help="HF folder or .gguf for the engine and tokenizer models "
                                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", type=_key_value,
                   help="engine parameter for the engine models, e.g. max_num_seqs=32")
    p.add_argument("--load-model", action="append", default=[], metavar="NAME",
                   help="load only these models (default: all)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    return p.parse_args(argv)


def repository_for(args: argparse.Namespace) -> Path:
    """The repository as given, or a copy with the requested overrides."""
    if not args.model and not args.param:
        return args.model_repository
    engine_params = dict(args.param)
    if args.model:
        engine_params["model"] = str(Path(args.model).resolve())
    params = {name: engine_params for name in ENGINE_MODELS}
    if args.model:
        params.update({name: {"tokenizer": str(Path(args.model).resolve())} for name in TOKENIZER_MODELS})
    target = REPO_ROOT / ".triton" / "model_repository"
    shutil.rmtree(target, ignore_errors=True)
    return copy_repository(args.model_repository, target, params=params)


def check_libpython() -> None:
    name = f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0"
    try:
        ctypes.CDLL(name)
    except OSError:
        sys.exit(f"serve: the Triton python backend stub needs {name} "
                 f"(Debian/Ubuntu: apt-get install libpython{sys.version_info.major}.{sys.version_info.minor})")


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    check_libpython()
    prepare_server_dir()
    if not args.model:
        # Convert the embedded GGUF once here; otherwise every model process would
        # convert it concurrently on first start.
        from engine.models.gguf_cache import default_model_dir
        default_model_dir()
    extra = ["--exit-timeout-secs=30"]
    if args.load_model:
        extra += ["--model-control-mode=explicit", *[f"--load-model={m}" for m in args.load_model]]
    server = TritonServer(repository_for(args), ServerPorts(args.http_port, args.grpc_port, args.metrics_port),
                          host=args.host, extra_args=extra)
    server.start()
    stop = lambda *_: server.stop()  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    try:
        server.wait_ready(args.ready_timeout)
        print(f"\nTriton ready in {time.monotonic() - started:.1f} s (since serve started)\n"
              f"  HTTP     http://{server.http_url}   (POST /v2/models/llm/generate, /generate_stream)\n"
              f"  gRPC     {server.grpc_url}\n"
              f"  metrics  {server.metrics_url}\n", flush=True)
        return server.process.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
