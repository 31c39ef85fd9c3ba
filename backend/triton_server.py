"""Run NVIDIA's tritonserver from the nvidia-pytriton wheel without Docker.

Shared by scripts/serve.py and the e2e test launcher so both start the server the
same way. Pure stdlib: it must work before the engine's heavy imports and must not
import Triton's python-backend utils.

tritonserver runs in its own process group (its python backend stubs join it) and never
outlives the process that started it: on Linux it gets SIGKILL when the starting thread
dies (PR_SET_PDEATHSIG), and a small reaper process SIGKILLs the whole group, stubs
included, once the starting process is gone or has stopped the server.

Over 300 lines: starting, watching and reaping tritonserver share the process-group
handling; it moves to its own package with issue 48 item 3.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from backend.log_relay import LogRelay

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SERVER_DIR = REPO_ROOT / ".triton" / "server"
# The Python-based backend of model_repository/llm (`backend: "tle"`).
BACKEND_NAME = "tle"
BACKEND_MODEL_PY = REPO_ROOT / "backend" / "triton_backend" / "model.py"


def _pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed; run scripts/setup.sh")
    return Path(list(spec.submodule_search_locations)[0])


def wheel_libs_dir() -> Path:
    # auditwheel puts the server's shared libraries next to the package.
    return _pytriton_root().parent / "nvidia_pytriton.libs"


def prepare_server_dir(target: Path = DEFAULT_SERVER_DIR) -> Path:
    """Lay out bin/ and backends/ with the stub for this Python, once (`tle`: each call).

    The wheel keeps one stub per Python version in python_backend_stubs/; the python
    backend looks for triton_python_backend_stub inside its own folder, so the stub
    matching the venv's interpreter is copied there; a marker makes later calls cheap."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    marker = target / f".ready-{version}"
    if marker.exists():
        install_backend(target)
        return target
    source = _pytriton_root() / "tritonserver"
    stub = source / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"the pytriton wheel has no python backend stub for Python {version}")
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
    shutil.copy2(stub, staging / "backends" / "python" / "triton_python_backend_stub")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    install_backend(target)
    marker.touch()
    return target


def install_backend(server_dir: Path) -> None:
    """backends/tle/model.py: Triton runs a backend folder holding a model.py as a
    Python-based backend. Replaced by a rename, and only when this checkout's differs."""
    target = server_dir / "backends" / BACKEND_NAME / "model.py"
    source = BACKEND_MODEL_PY.read_bytes()
    if not target.is_file() or target.read_bytes() != source:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".model.py.{os.getpid()}")
        partial.write_bytes(source)
        os.replace(partial, target)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PR_SET_PDEATHSIG = 1

# Run as `python -I -S -c _REAPER PGID` with stdin the read end of a pipe whose write end
# only the starting process holds: EOF means that process closed it (TritonServer.stop)
# or died, and whatever is left of the group goes. stdlib only, no site: starts in ~20 ms.
_REAPER = """
import os, signal, sys
for s in (signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
while os.read(0, 512):
    pass
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn making the child get SIGKILL when the calling thread exits.

    Linux only, and only from the main thread: the kernel sends the signal when the
    *thread* that forked the child exits, which for the main thread means the process.
    prctl is looked up here, before the fork, so the child only makes the call."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def preexec() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


@dataclass(slots=True)
class ServerPorts:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    @classmethod
    def free(cls) -> "ServerPorts":
        return cls(free_port(), free_port(), free_port())


@dataclass(slots=True)
class TritonServer:
    """One tritonserver process serving `model_repository`."""
    model_repository: Path
    ports: ServerPorts = field(default_factory=ServerPorts)
    log_path: Path | None = None
    host: str = "127.0.0.1"
    extra_args: list[str] = field(default_factory=list)
    # Searched before the repository root by the models' Python.
    pythonpath: list[str] = field(default_factory=list)
    server_dir: Path = DEFAULT_SERVER_DIR
    process: subprocess.Popen | None = None
    _log_file: object = None
    _reaper: subprocess.Popen | None = None
    _reaper_pipe: int | None = None
    _stop_sent: bool = False
    _relay: LogRelay | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports.metrics}/metrics"

    def command(self) -> list[str]:
        return [str(self.server_dir / "bin" / "tritonserver"),
                f"--model-repository={self.model_repository}",
                f"--backend-directory={self.server_dir / 'backends'}",
                f"--http-address={self.host}", f"--http-port={self.ports.http}",
                f"--grpc-address={self.host}", f"--grpc-port={self.ports.grpc}",
                f"--metrics-address={self.host}", f"--metrics-port={self.ports.metrics}",
                "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
                *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        libs = str(wheel_libs_dir())
        # LIBDIR: where this interpreter's libpython3.X.so.1.0, which the python backend
        # stub links, lies when it is not in the system's (pyenv, python.org, uv builds).
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libs, env.get("LD_LIBRARY_PATH"), sysconfig.get_config_var("LIBDIR")) if p)
        # The stub runs `python` semantics from PATH: the venv first makes model.py
        # import the venv's torch/transformers, and the repo on PYTHONPATH makes
        # `import backend` resolve to this checkout.
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join((venv_bin, env.get("PATH", "")))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (*self.pythonpath, str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        return env

    def start(self) -> "TritonServer":
        prepare_server_dir(self.server_dir)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")
            sink = self._log_file
        else:
            sink = sys.stdout.buffer  # serve prints the server log on its console
        self._stop_sent = False
        # Through a relay that folds repeated lines (backend/log_relay.py).
        self.process = subprocess.Popen(self.command(), env=self.environment(), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_die_with_parent(),
                                        # The stub puts the working folder first on sys.path;
                                        # this one holds no Python packages to shadow ours.
                                        cwd=self.server_dir)
        self._relay = LogRelay(self.process.stdout, sink)
        self._start_reaper(self.process.pid)
        return self

    def _start_reaper(self, pgid: int) -> None:
        read_end, write_end = os.pipe()  # not inheritable: only this process holds write_end
        try:
            self._reaper = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER, str(pgid)],
                                            stdin=read_end, start_new_session=True)
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self._reaper_pipe = write_end

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Blocks until the server answers ready; returns the seconds waited."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} "
                                   f"before becoming ready{self._log_hint()}")
            if self.is_ready():
                return time.monotonic() - start
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s{self._log_hint()}")

    def _log_hint(self) -> str:
        return f"; log: {self.log_path}" if self.log_path else ""

    def request_stop(self) -> None:
        """Asks tritonserver once to stop gracefully; returns at once (safe in a signal handler).

        SIGINT makes Triton refuse new requests and unload the models, which runs each
        model's finalize; it waits for in-flight requests up to --exit-timeout-secs."""
        proc = self.process
        if proc is None or self._stop_sent:
            return
        self._stop_sent = True
        proc.send_signal(signal.SIGINT)  # polls first: never signals a reaped pid

    def kill(self) -> None:
        """SIGKILLs tritonserver and its stubs (its process group); returns at once."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful stop, SIGKILL after `timeout`; then kills anything left in the group."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            self.request_stop()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                proc.wait(timeout=10)
        self._reap_group()
        if self._relay is not None:
            self._relay.join(timeout=5)  # the group is gone: the pipe has closed
            self._relay = None
            proc.stdout.close()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _reap_group(self) -> None:
        # Normally nothing is left: Triton stops its stubs before it exits. A stub can
        # outlive it when Triton gave up at the exit timeout with requests in flight.
        if self._reaper_pipe is not None:
            os.close(self._reaper_pipe)
            self._reaper_pipe = None
        if self._reaper is not None:
            try:
                self._reaper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
                self._reaper.wait()
            self._reaper = None
