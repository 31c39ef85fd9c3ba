"""Serve model_repository with the tritonserver from the nvidia-pytriton wheel.

    scripts/serve.sh [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
                     [--host 127.0.0.1] [--model PATH] [--param KEY=VALUE ...]
                     [--lora-modules NAME=PATH ...]
                     [--load-model llm ...] [--exit-timeout-secs 20]
                     [--restrict-api KEY | --restrict-api-file PATH]

Ports and host may also come from TRITON_HTTP_PORT / TRITON_GRPC_PORT /
TRITON_METRICS_PORT / TRITON_HOST. --model and --param override the engine models'
(llm, tensorrt_llm) config.pbtxt parameters in a copy of the repository under .triton/
(config.pbtxt parameters win over a model.json); --model is the one place to set the
model: preprocessing and postprocessing take their tokenizer from tensorrt_llm's config
(backend/tokenizer_source.py). The server folder it prepares (.triton/server) holds the
`tle` backend that `llm` runs on (backend/triton_server.py install_backend).

--restrict-api KEY (or --restrict-api-file PATH, or $TRITON_ADMIN_KEY) puts Triton's
model-repository, model-config, shared-memory, trace and logging APIs behind the header
`admin-key: KEY` on HTTP and gRPC (backend/restricted_api.py); inference stays open.

SIGTERM or SIGINT (Ctrl-C) stops tritonserver gracefully: it refuses new requests, lets
in-flight ones finish, unloads the models, and serve exits with status 0 as soon as it
has stopped (requests still running after --exit-timeout-secs are cut: tritonserver is
killed). A second SIGTERM/SIGINT kills it at once. tritonserver and its python backend
stubs never outlive serve, even when serve is SIGKILLed.

A python backend stub that dies while its model is loaded (SIGKILL, OOM) leaves its
requests hanging inside tritonserver (backend/stub_watch.py): serve notices within a
second, logs it and kills tritonserver, which ends those streams with an error. With
--health-check it then starts tritonserver again (the models load anew and serve);
without, it exits with status 1 for a supervisor to restart. tritonserver may also die
of a stub's death by itself before serve looks (Triton's python backend aborts on a
boost::interprocess::lock_exception now and then): --health-check starts it again after
any crash (a signal serve did not send) once it had been ready, and only then, so a
server that cannot start is not started again and again.

Over 300 lines: every serve flag maps to a config.pbtxt parameter or a tritonserver
option here, in the one table --help shows.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.open_files import raise_open_file_limit  # noqa: E402
from backend.repository_layout import copy_repository  # noqa: E402
from backend.restricted_api import http_headers, read_key, tritonserver_flags  # noqa: E402
from backend.stub_watch import StubDied, StubWatch, describe  # noqa: E402
from backend.triton_server import REPO_ROOT, ServerPorts, TritonServer, prepare_server_dir  # noqa: E402

ENGINE_MODELS = ("llm", "tensorrt_llm")
OVERRIDES_DIR = REPO_ROOT / ".triton" / "model_repository"


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
    p.add_argument("--model", help="HF folder or .gguf for the engine models, whose tokenizer "
                                   "preprocessing/postprocessing follow "
                                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", type=_key_value,
                   help="engine parameter for the engine models, e.g. max_num_seqs=32")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) the engine models serve by name "
                        "(vLLM's flag); turns on enable_lora")
    p.add_argument("--instances", type=int, default=0, metavar="N",
                   help="N instances (KIND_CPU, or KIND_GPU one device each with --instance-kind) "
                        "of each engine model, each its own engine; Triton spreads requests over them")
    p.add_argument("--instance-kind", default="KIND_CPU", choices=("KIND_CPU", "KIND_GPU"))
    p.add_argument("--load-model", action="append", default=[], metavar="NAME",
                   help="load only these models (default: all)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--health-check", action="store_true",
                   help="start tritonserver again when a backend stub dies (default: exit 1) "
                        "or when it crashes after it was ready (default: its status)")
    p.add_argument("--exit-timeout-secs", type=int, default=20, metavar="S",
                   help="on SIGTERM/SIGINT, how long in-flight requests may run before "
                        "tritonserver is killed (default: 20, within Kubernetes' 30 s grace period)")
    p.add_argument("--restrict-api", metavar="KEY", default=None,
                   help="Triton's admin APIs (model repository, config, shared memory, trace, "
                        "logging) need the header `admin-key: KEY` (default: $TRITON_ADMIN_KEY)")
    p.add_argument("--restrict-api-file", metavar="PATH", type=Path, default=None,
                   help="--restrict-api's key read from this file (e.g. a mounted Secret)")
    args = p.parse_args(argv)
    try:
        args.admin_key = read_key(args.restrict_api, args.restrict_api_file)
    except ValueError as exc:
        p.error(str(exc))
    return args


def repository_for(args: argparse.Namespace, target: Path = OVERRIDES_DIR) -> Path:
    """The repository as given, or a copy at `target` with the requested overrides."""
    if not args.model and not args.param and not args.instances and not args.lora_modules:
        return args.model_repository
    engine_params = dict(args.param)
    if args.lora_modules:
        # Absolute, as --model: the server's working folder is not the caller's.
        engine_params["enable_lora"] = "true"
        engine_params["lora_modules"] = " ".join(
            f"{name}={Path(path).resolve()}" for name, _, path in
            (item.partition("=") for item in args.lora_modules))
    if args.model:
        # Absolute: tritonserver runs in .triton/server, not the caller's directory.
        engine_params["model"] = str(Path(args.model).resolve())
    shutil.rmtree(target, ignore_errors=True)
    instances = ({name: (args.instances, args.instance_kind) for name in ENGINE_MODELS}
                 if args.instances else None)
    return copy_repository(args.model_repository, target,
                           params={name: engine_params for name in ENGINE_MODELS},
                           instances=instances)


def check_libpython() -> None:
    name = f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0"
    try:
        ctypes.CDLL(name)
    except OSError:
        sys.exit(f"serve: the Triton python backend stub needs {name} "
                 f"(Debian/Ubuntu: apt-get install libpython{sys.version_info.major}.{sys.version_info.minor})")


# With requests still in flight at its exit timeout, Triton "exits immediately" and that
# exit crashes (SIGSEGV/SIGABRT in its backends' threads), sometimes hanging in its crash
# handler. So serve enforces --exit-timeout-secs itself, by SIGKILLing tritonserver and
# its stubs, and passes Triton this much more as a backstop.
TRITON_EXTRA_EXIT_S = 5


class StopSignals:
    """SIGTERM/SIGINT handling: the first signal asks tritonserver to stop gracefully,
    a second one kills it. The handler never blocks; the main thread does the waiting."""

    def __init__(self) -> None:
        self.server: TritonServer | None = None
        self.received: list[int] = []
        self.first_at = 0.0

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handle)

    def handle(self, signum: int, _frame: object = None) -> None:
        self.received.append(signum)
        name = signal.Signals(signum).name
        # os.write, not print: the handler may interrupt a print of the main thread.
        if len(self.received) == 1:
            self.first_at = time.monotonic()
            os.write(2, f"\nserve: {name}: stopping tritonserver ({name} again to kill it)\n".encode())
            if self.server is not None:
                self.server.request_stop()
        else:
            os.write(2, f"\nserve: {name} again: killing tritonserver\n".encode())
            if self.server is None:
                raise SystemExit(self.killed_status)
            self.server.kill()

    def attach(self, server: TritonServer) -> None:
        """From now on signals go to `server`; one that came before still counts."""
        self.server = server
        if len(self.received) == 1:
            server.request_stop()  # idempotent: a signal racing this line sends one SIGINT
        elif self.received:
            server.kill()

    @property
    def stopping(self) -> bool:
        return bool(self.received)

    @property
    def killed(self) -> bool:
        return len(self.received) > 1

    @property
    def killed_status(self) -> int:
        return 128 + self.received[-1]


def wait_ready(server: TritonServer, signals: StopSignals, timeout: float) -> bool | None:
    """True once tritonserver is ready, False if it exits or a stop is requested first,
    None after `timeout`."""
    deadline = time.monotonic() + timeout
    while not signals.stopping and server.process.poll() is None:
        if server.is_ready():
            return True
        if time.monotonic() > deadline:
            return None
        time.sleep(0.25)
    return False


def wait_exit(server: TritonServer, signals: StopSignals, exit_timeout: float,
              watch: StubWatch | None = None) -> int:
    """tritonserver's status as soon as it exits: it is reaped at once, never left a
    zombie. A requested stop still running `exit_timeout` s after the signal (requests
    in flight) ends with SIGKILL to tritonserver and its stubs. A stub that `watch` sees
    die kills tritonserver too (its requests would hang forever) and raises StubDied."""
    cut = False
    next_look = time.monotonic() + 1.0
    while True:
        try:
            return server.process.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if (watch is not None and signals.stopping and not cut and not signals.killed
                and time.monotonic() >= next_look):
            # The stubs go with their models now; one that dies of a signal is still told
            # (not those serve kills itself: a second signal, the exit timeout).
            next_look = time.monotonic() + 1.0
            for stub, status in watch.crashed_while_stopping():
                print(f"serve: backend stub crashed during the stop: {describe(stub, status)}",
                      file=sys.stderr, flush=True)
        if watch is not None and not signals.stopping and time.monotonic() >= next_look:
            next_look = time.monotonic() + 1.0
            died = watch.died()
            if died and not signals.stopping:
                error = StubDied(died, watch.statuses)
                print(f"serve: backend stub died: {error}; its requests cannot finish inside "
                      "tritonserver: killing tritonserver to end them", file=sys.stderr, flush=True)
                server.kill()
                server.process.wait()
                raise error
        if signals.stopping and not cut and time.monotonic() - signals.first_at >= exit_timeout:
            print(f"serve: tritonserver still running at the exit timeout ({exit_timeout:g} s), "
                  "in-flight requests are cut: killing it", file=sys.stderr, flush=True)
            server.kill()
            cut = True


def exit_status(returncode: int, signals: StopSignals) -> int:
    """0 after a stop requested by one signal (even if the exit timeout cut requests),
    128+N after a second signal N, tritonserver's own status when it exited by itself."""
    if signals.killed:
        return signals.killed_status
    if signals.stopping:
        print(f"serve: tritonserver stopped {time.monotonic() - signals.first_at:.1f} s after "
              f"the stop request (status {returncode})", file=sys.stderr, flush=True)
        return 0
    print(f"serve: tritonserver exited by itself with status {returncode}", file=sys.stderr, flush=True)
    return 128 - returncode if returncode < 0 else returncode  # -N: killed by signal N


def start_and_wait(server: TritonServer, signals: StopSignals,
                   args: argparse.Namespace) -> bool | None:
    """Starts tritonserver and waits for it: True once ready, False if a stop came first,
    None if it was not ready in time (it is stopped then, with a line saying so)."""
    server.start()
    signals.attach(server)
    ready = wait_ready(server, signals, args.ready_timeout)
    if ready is None:
        print(f"serve: tritonserver not ready after {args.ready_timeout:.0f} s", file=sys.stderr)
        server.stop(args.exit_timeout_secs)
    return ready


def crash_signal(returncode: int, signals: StopSignals) -> str | None:
    """The signal's name when tritonserver died of one that no stop request of serve's
    sent (an abort, a segfault, the OOM killer); None for an exit or a requested stop."""
    if returncode >= 0 or signals.stopping:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def supervise(server: TritonServer, signals: StopSignals, args: argparse.Namespace,
              ready: bool = True) -> int:
    """Waits for tritonserver's exit. With --health-check, starts it again after a stub
    died, or after it crashed once `ready` (never ready: its own status, no retry)."""
    while True:
        watch = StubWatch(server.process.pid, server.http_url, http_headers(args.admin_key))
        try:
            returncode = wait_exit(server, signals, args.exit_timeout_secs, watch)
        except StubDied:
            server.stop()  # the reaper and the log; what is left of the group goes
            if not args.health_check:
                print("serve: exiting with status 1 (--health-check starts tritonserver again)",
                      file=sys.stderr, flush=True)
                return 1
        else:
            crash = crash_signal(returncode, signals)
            if crash is None or not (args.health_check and ready):
                return exit_status(returncode, signals)
            print(f"serve: tritonserver crashed ({crash}) while serving", file=sys.stderr, flush=True)
            server.stop()  # its stubs outlive it otherwise
        print("serve: --health-check: starting tritonserver again", file=sys.stderr, flush=True)
        restarted = time.monotonic()
        ready = start_and_wait(server, signals, args)
        if ready is None:
            return 1
        if ready:
            print(f"serve: tritonserver ready again in {time.monotonic() - restarted:.1f} s",
                  file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    check_libpython()
    # Each HTTP/gRPC connection holds one of tritonserver's descriptors (it inherits the
    # limit): at the usual soft limit, 1024, a few thousand idle connections made its HTTP
    # server log accept() errors in a loop (~40 MB/s) with health unanswered meanwhile.
    before, after = raise_open_file_limit()
    if after != before:
        print(f"serve: open-file limit raised from {before} to {after} (the hard limit) for "
              "tritonserver's connections", file=sys.stderr, flush=True)
    signals = StopSignals()
    signals.install()
    prepare_server_dir()
    # Convert a GGUF (the embedded default included) once here, otherwise every model
    # process converts it at once on first start; a bad --model fails before the server.
    from engine.api import resolve_model_dir
    try:
        resolve_model_dir(args.model)
    except (OSError, ValueError) as exc:
        sys.exit(f"serve: {exc}")
    repository = repository_for(args)
    if signals.stopping:
        return 0
    extra = [f"--exit-timeout-secs={args.exit_timeout_secs + TRITON_EXTRA_EXIT_S}"]
    if args.load_model:
        extra += ["--model-control-mode=explicit", *[f"--load-model={m}" for m in args.load_model]]
    if args.admin_key:
        extra += tritonserver_flags(args.admin_key)
    server = TritonServer(repository, ServerPorts(args.http_port, args.grpc_port, args.metrics_port),
                          host=args.host, extra_args=extra)
    try:
        ready = start_and_wait(server, signals, args)
        if ready is None:
            return 1
        if ready:
            print(f"\nTriton ready in {time.monotonic() - started:.1f} s (since serve started)\n"
                  f"  HTTP     http://{server.http_url}   (POST /v2/models/llm/generate, /generate_stream)\n"
                  f"  gRPC     {server.grpc_url}\n"
                  f"  metrics  {server.metrics_url}\n"
                  + ("  admin APIs need the header admin-key (--restrict-api)\n"
                     if args.admin_key else ""), flush=True)
        return supervise(server, signals, args, ready)
    finally:
        if signals.killed:
            server.kill()
        server.stop()  # normally it has exited: this only kills what is left of its group


if __name__ == "__main__":
    sys.exit(main())
