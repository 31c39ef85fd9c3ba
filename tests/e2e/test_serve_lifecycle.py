"""scripts/serve.py's lifecycle. SIGTERM/SIGINT stop tritonserver gracefully and serve
exits 0 as soon as it has stopped (in-flight requests run until --exit-timeout-secs), a
second signal kills at once, and nothing serve started outlives it, even when serve is
SIGKILLed. The slow tests run the real serve.py on the default model (only `llm`, one
start per scenario); the fast ones drive the same code against a stand-in tritonserver."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT, ServerPorts, TritonServer

_spec = importlib.util.spec_from_file_location("serve", REPO_ROOT / "scripts" / "serve.py")
serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve)

# A repository of its own (not serve --param, which rewrites .triton/model_repository
# under the checkout). fp32 also loads on CPUs without native bf16; small batch.
ENGINE_PARAMS = {"dtype": "float32", "max_num_seqs": "8"}
PROMPT = "Once upon a time"
LONG_TOKENS = 1500  # minutes on CPU: still running when the exit timeout cuts it
SHORT_TOKENS = 24  # ~2.5 s here: finishes during the drain
EXIT_TIMEOUT_S = 8
IDLE_STOP_S = 10.0  # measured ~2 s
KILLED_GONE_S = 5.0  # measured < 0.1 s (tritonserver, stub and reaper)


# --- processes, as /proc sees them ----------------------------------------------------

def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # [state, ppid, ..., starttime at 19]


@dataclass(frozen=True)
class Proc:
    pid: int
    name: str
    started: str  # /proc starttime: a recycled pid does not pass for this process

    def alive(self) -> bool:
        """Running, or stopped; a zombie (exited, not reaped yet) counts as dead."""
        stat = _stat(self.pid)
        return stat is not None and stat[19] == self.started and stat[0] != "Z"


def proc(pid: int) -> Proc | None:
    stat = _stat(pid)
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    return Proc(pid, name, stat[19]) if stat is not None and stat[0] != "Z" else None


def descendants(pid: int) -> list[Proc]:
    found, parents = [], {pid}
    while parents:
        children = []
        for entry in os.listdir("/proc"):
            stat = _stat(int(entry)) if entry.isdigit() else None
            if stat is not None and int(stat[1]) in parents:
                child = proc(int(entry))
                children += [child] if child is not None else []
        found += children
        parents = {c.pid for c in children}
    return found


def wait_dead(procs: list[Proc], timeout: float) -> list[Proc]:
    deadline = time.monotonic() + timeout
    while any(p.alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p for p in procs if p.alive()]


def port_listened(host: str, port: int) -> bool:
    """Whether some process still listens on the port (TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen()
        except OSError:
            return True
    return False


# --- the real serve.py --------------------------------------------------------------------

@dataclass
class Stopped:
    signalled_at: float  # time.monotonic()
    returncode: int | None
    serve_s: float | None  # seconds from the signal to serve's exit
    tritonserver_s: float | None  # ... to tritonserver's exit (a zombie counts as exited)
    gone_s: float | None  # ... until serve and everything it started were gone
    survivors: list[Proc]


@dataclass
class Served:
    process: subprocess.Popen
    ports: ServerPorts
    log: Path
    tree: list[Proc] = field(default_factory=list)  # tritonserver, its stubs, the reaper

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def tritonserver(self) -> Proc:
        return next(p for p in self.tree if p.name == "tritonserver")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def signal_and_watch(self, signum: int, limit: float) -> Stopped:
        started = time.monotonic()
        os.kill(self.process.pid, signum)
        serve_s = tritonserver_s = gone_s = None
        while time.monotonic() - started < limit:
            now = time.monotonic() - started
            if tritonserver_s is None and not self.tritonserver.alive():
                tritonserver_s = now
            if serve_s is None and self.process.poll() is not None:
                serve_s = now
            if serve_s is not None and not any(p.alive() for p in self.tree):
                gone_s = now
                break
            time.sleep(0.02)
        return Stopped(started, self.process.poll(), serve_s, tritonserver_s, gone_s,
                       [p for p in self.tree if p.alive()])

    def assert_all_gone(self, stopped: Stopped) -> None:
        assert not stopped.survivors, f"outlived serve: {stopped.survivors}\n{self.log_tail()}"
        busy = [port for port in (self.ports.http, self.ports.grpc, self.ports.metrics)
                if port_listened("127.0.0.1", port)]
        assert not busy, f"ports still listened on: {busy}"


def _is_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture
def launch(request, tmp_path):
    """Starts scripts/serve.py on free ports and waits until it is ready."""
    started: list[Served] = []

    def start(*extra: str) -> Served:
        repo = copy_repository(REPO_ROOT / "model_repository", tmp_path / f"models{len(started)}",
                               models=["llm"], params={"llm": ENGINE_PARAMS})
        ports = ServerPorts.free()
        log = tmp_path / f"serve{len(started)}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, str(REPO_ROOT / "scripts" / "serve.py"), "--model-repository", str(repo),
                 "--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
                 "--metrics-port", str(ports.metrics), *extra],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        served = Served(process, ports, log)
        started.append(served)
        deadline = time.monotonic() + 420
        while not _is_ready(ports.http):
            assert process.poll() is None, f"serve exited with {process.returncode}\n{served.log_tail()}"
            assert time.monotonic() < deadline, f"serve not ready\n{served.log_tail()}"
            time.sleep(0.25)
        served.tree = descendants(process.pid)
        names = sorted(p.name for p in served.tree)
        assert names.count("tritonserver") == 1 and "triton_python_b" in names, names
        return served

    yield start
    for served in started:  # a failed test must not leave a server behind
        if served.process.poll() is None:
            served.process.kill()
            served.process.wait()
        for left in wait_dead(served.tree, 5.0):
            os.kill(left.pid, signal.SIGKILL)
        if getattr(request.session, "e2e_failed", False):
            target = REPO_ROOT / "test-logs"
            target.mkdir(exist_ok=True)
            shutil.copyfile(served.log, target / f"serve-lifecycle-{time.strftime('%Y%m%d-%H%M%S')}"
                                                 f"-{served.log.stem}.log")


class Stream:
    """One streaming request on its own gRPC stream."""

    def __init__(self, url: str, max_tokens: int) -> None:
        import tritonclient.grpc as grpcclient

        from tests.e2e.triton_clients import llm_inputs, tensors_to_inputs

        self.responses = 0
        self.final = False
        self.final_at = 0.0
        self.error: str | None = None
        self.first = threading.Event()
        self.done = threading.Event()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_response)
        sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        self.client.async_stream_infer("llm", tensors_to_inputs(llm_inputs(PROMPT, sampling, stream=True)),
                                       request_id="0", enable_empty_final_response=True)

    def _on_response(self, result, error) -> None:
        if self.done.is_set():
            return  # e.g. the stream closing after the final response
        if error is not None:
            self.error = str(error)
            self.done.set()
        else:
            self.responses += 1
            if result.get_response().parameters["triton_final_response"].bool_param:
                self.final = True
                self.final_at = time.monotonic()
                self.done.set()
        self.first.set()

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


@pytest.mark.slow
def test_sigterm_lets_a_short_stream_finish_cuts_a_long_one_and_exits_0(launch):
    served = launch(f"--exit-timeout-secs={EXIT_TIMEOUT_S}")
    long = Stream(served.grpc, LONG_TOKENS)
    short = None
    try:
        assert long.first.wait(60), "no response to the long request"
        short = Stream(served.grpc, SHORT_TOKENS)
        assert short.first.wait(60), "no response to the short request"
        stopped = served.signal_and_watch(signal.SIGTERM, limit=60)
        long.done.wait(10)
    finally:
        for stream in (long, short):
            if stream is not None:
                stream.close()

    bound = EXIT_TIMEOUT_S + 2  # serve kills tritonserver at the exit timeout
    assert stopped.returncode == 0, served.log_tail()
    assert stopped.serve_s is not None and stopped.serve_s < bound, (stopped, served.log_tail())
    # No zombie phase: serve reaps tritonserver and exits right away.
    assert stopped.serve_s - stopped.tritonserver_s < 1.0, stopped
    served.assert_all_gone(stopped)
    # The short request was in flight at the signal and got its whole answer.
    assert short.final and short.error is None and short.responses >= SHORT_TOKENS, vars(short)
    assert short.final_at > stopped.signalled_at
    assert long.final or any(code in (long.error or "") for code in ("UNAVAILABLE", "CANCELLED")), vars(long)
    assert long.responses > 1


@pytest.mark.slow
def test_idle_server_stops_on_sigint_in_seconds(launch):
    from tests.e2e.triton_clients import infer_one, llm_inputs

    served = launch()
    served_one = infer_one(served.grpc, "llm", llm_inputs(PROMPT, {"max_tokens": 4, "temperature": 0}))
    assert served_one.error is None and served_one.text
    stopped = served.signal_and_watch(signal.SIGINT, limit=60)
    assert stopped.returncode == 0, served.log_tail()
    assert stopped.serve_s is not None and stopped.serve_s < IDLE_STOP_S, (stopped, served.log_tail())
    assert stopped.serve_s - stopped.tritonserver_s < 1.0, stopped
    served.assert_all_gone(stopped)


@pytest.mark.slow
def test_sigkill_of_serve_takes_tritonserver_and_its_stubs_down(launch):
    served = launch()
    stream = Stream(served.grpc, LONG_TOKENS)
    try:
        assert stream.first.wait(60), "no response"  # the stub is busy generating
        stopped = served.signal_and_watch(signal.SIGKILL, limit=30)
        stream.done.wait(10)
    finally:
        stream.close()
    assert stopped.returncode == -signal.SIGKILL
    assert stopped.gone_s is not None and stopped.gone_s < KILLED_GONE_S, (stopped, served.log_tail())
    served.assert_all_gone(stopped)
    assert stream.error is not None and "UNAVAILABLE" in stream.error, vars(stream)


# --- the same code against a stand-in tritonserver (fast) ---------------------------------

# argv[1]: "drains" exits 0 shortly after SIGINT, "hangs" ignores SIGINT, "fails" exits 3
# by itself, "crashes" aborts by itself (as Triton's python backend does now and then when
# a stub dies) unless the file argv[2] exists, which it makes first; then it drains. Its
# child stands for a python backend stub (same process group) that does not watch its
# parent, so only a kill of the whole group ends it.
STAND_IN = r"""
import os, resource, signal, subprocess, sys, time
mode = sys.argv[1]
stub = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
def on_sigint(*_):
    if mode in ("drains", "crashes"):
        time.sleep(0.3)
        stub.kill()
        stub.wait()
        sys.exit(0)
signal.signal(signal.SIGINT, on_sigint)
print("up", flush=True)
if mode == "fails":
    time.sleep(0.3)
    stub.kill()
    stub.wait()
    sys.exit(3)
if mode == "crashes" and not os.path.exists(sys.argv[2]):
    open(sys.argv[2], "w").close()
    time.sleep(1.0)  # the test has seen it up and listed its group by then
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()
while True:
    time.sleep(1)
"""


class StandIn(TritonServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", STAND_IN, *self.extra_args]

    def is_ready(self) -> bool:  # it has no HTTP: ready once it said so
        return self.process.poll() is None and "up" in self.log_path.read_text()


def _start_stand_in(tmp_path: Path, *argv: str) -> tuple[StandIn, list[Proc]]:
    # An existing marker makes prepare_server_dir a no-op.
    (tmp_path / f".ready-{sys.version_info.major}.{sys.version_info.minor}").touch()
    server = StandIn(tmp_path, log_path=tmp_path / "stand-in.log", server_dir=tmp_path, extra_args=list(argv))
    server.start()
    deadline = time.monotonic() + 30
    while "up" not in server.log_path.read_text():
        assert server.process.poll() is None and time.monotonic() < deadline, server.log_path.read_text()
        time.sleep(0.02)
    # The stand-in and its stub (the process group), then the reaper.
    group = [proc(server.process.pid), *descendants(server.process.pid), proc(server._reaper.pid)]
    assert None not in group and len(group) == 3, group
    return server, group


@pytest.fixture
def handlers():
    """serve's SIGTERM/SIGINT handlers in this process, restored afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signals = serve.StopSignals()
    signals.install()
    yield signals
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_first_signal_stops_tritonserver_and_serve_exits_0(tmp_path, handlers):
    server, group = _start_stand_in(tmp_path, "drains")
    try:
        handlers.attach(server)
        os.kill(os.getpid(), signal.SIGTERM)
        started = time.monotonic()
        returncode = serve.wait_exit(server, handlers, exit_timeout=30)
        assert time.monotonic() - started < 2.0
        assert returncode == 0 and serve.exit_status(returncode, handlers) == 0
    finally:
        server.stop(timeout=5)
    assert not wait_dead(group, 2.0)


def test_second_signal_kills_tritonserver_and_its_stubs_at_once(tmp_path, handlers):
    server, group = _start_stand_in(tmp_path, "hangs")
    try:
        handlers.attach(server)
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        returncode = serve.wait_exit(server, handlers, exit_timeout=30)
        assert time.monotonic() - started < 2.0
        assert returncode == -signal.SIGKILL
        assert serve.exit_status(returncode, handlers) == 128 + signal.SIGINT
        assert not wait_dead(group[:2], 2.0)  # the group: stand-in and stub
    finally:
        server.stop(timeout=5)
    assert not wait_dead(group, 2.0)


def test_stop_still_running_at_the_exit_timeout_is_cut_and_still_exits_0(tmp_path, handlers):
    server, group = _start_stand_in(tmp_path, "hangs")
    try:
        handlers.attach(server)
        os.kill(os.getpid(), signal.SIGTERM)
        started = time.monotonic()
        returncode = serve.wait_exit(server, handlers, exit_timeout=1.0)
        assert 1.0 <= time.monotonic() - started < 2.0
        assert returncode == -signal.SIGKILL
        assert serve.exit_status(returncode, handlers) == 0
    finally:
        server.stop(timeout=5)
    assert not wait_dead(group, 2.0)


def test_tritonserver_failing_by_itself_gives_its_status(tmp_path, handlers):
    server, group = _start_stand_in(tmp_path, "fails")
    try:
        handlers.attach(server)
        returncode = serve.wait_exit(server, handlers, exit_timeout=30)
        assert returncode == 3 and serve.exit_status(returncode, handlers) == 3
    finally:
        server.stop(timeout=5)
    assert not wait_dead(group, 2.0)


def test_health_check_starts_tritonserver_again_after_it_crashed_while_serving(
        tmp_path, handlers, capsys):
    server, group = _start_stand_in(tmp_path, "crashes", str(tmp_path / "crashed"))
    first = server.process
    args = serve.parse_args(["--health-check", "--ready-timeout", "30"])

    def stop_once_serving_again() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (server.process is not first and server.is_ready()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # late: the assertions below say what failed

    try:
        handlers.attach(server)
        threading.Thread(target=stop_once_serving_again, daemon=True).start()
        status = serve.supervise(server, handlers, args, ready=True)
    finally:
        server.stop(timeout=5)
    err = capsys.readouterr().err
    assert first.returncode == -signal.SIGABRT, err
    assert "serve: tritonserver crashed (SIGABRT) while serving" in err
    assert "--health-check: starting tritonserver again" in err
    assert server.process is not first and server.process.returncode == 0, err  # drained
    assert status == 0, err
    assert not wait_dead(group, 2.0)  # the crashed one's stub too


@pytest.mark.parametrize("health_check,ready", [(False, True), (True, False)],
                         ids=["without_health_check", "crashed_before_ready"])
def test_a_crash_is_not_started_again_without_health_check_or_before_ready(
        tmp_path, handlers, capsys, health_check, ready):
    server, group = _start_stand_in(tmp_path, "crashes", str(tmp_path / "crashed"))
    first = server.process
    args = serve.parse_args(["--ready-timeout", "30"] + ["--health-check"] * health_check)
    try:
        handlers.attach(server)
        status = serve.supervise(server, handlers, args, ready=ready)
    finally:
        server.stop(timeout=5)
    err = capsys.readouterr().err
    assert server.process is first and status == 128 + signal.SIGABRT, err
    assert "exited by itself with status -6" in err and "starting tritonserver again" not in err
    assert not wait_dead(group, 2.0)


_STARTER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.e2e.test_serve_lifecycle import StandIn
server = StandIn(Path(sys.argv[2]), log_path=Path(sys.argv[2]) / "stand-in.log",
                 server_dir=Path(sys.argv[2]), extra_args=["hangs"]).start()
print(server.process.pid, server._reaper.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("reaper", ["with_reaper", "reaper_killed_first"])
def test_nothing_outlives_a_sigkilled_starter(tmp_path, reaper):
    (tmp_path / f".ready-{sys.version_info.major}.{sys.version_info.minor}").touch()
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, str(REPO_ROOT), str(tmp_path)],
                               stdout=subprocess.PIPE, text=True)
    leftovers: list[Proc] = []
    try:
        stand_in_pid, reaper_pid = map(int, starter.stdout.readline().split())
        deadline = time.monotonic() + 30
        while "up" not in (tmp_path / "stand-in.log").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        tree = descendants(starter.pid)
        stand_in = proc(stand_in_pid)
        [stub] = descendants(stand_in_pid)
        if reaper == "reaper_killed_first":
            reaper_proc = proc(reaper_pid)  # before the kill: afterwards it may be gone
            os.kill(reaper_pid, signal.SIGKILL)
            assert not wait_dead([reaper_proc], 2.0)
            leftovers = [stub]  # only the reaper would have killed it
        starter.kill()
        # PR_SET_PDEATHSIG ends tritonserver, the reaper its whole group.
        assert not wait_dead([stand_in], 2.0)
        if reaper == "with_reaper":
            assert not wait_dead(tree, 2.0), tree
    finally:
        starter.kill()
        starter.wait()
        for left in leftovers + descendants(starter.pid):
            if left.alive():
                os.kill(left.pid, signal.SIGKILL)
